"""From a step's logits to its tokens: penalties, temperature and truncation, the draw, logprobs, and
draft verification."""
