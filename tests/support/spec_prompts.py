"""Prompts whose answers repeat their input: where speculative decoding has drafts to verify."""

PASSAGES = [
    "The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "Kubernetes schedules pods onto nodes; the kubelet starts their containers.",
    "Paged attention stores keys and values in fixed-size blocks of sixteen tokens.",
    "Prometheus scrapes metrics over HTTP and evaluates recording rules every minute.",
    "A binary search halves the interval until the target value is found or not.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The treaty was signed in 1648 and ended thirty years of war in central Europe.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]
PROMPTS = [f"{verb} the following text{suffix}:\n{p}" for p in PASSAGES
           for verb, suffix in (("Repeat", " exactly"), ("Copy", ""), ("Summarise", " briefly"), ("Translate", " to French"))]
