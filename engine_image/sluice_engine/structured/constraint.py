"""One request's grammar state, as the engine's TokenConstraint (core/request.py): an xgrammar
GrammarMatcher that masks what may come next and advances with every token emitted; and the masking
kernel's backend, named, and its warm-up at engine start-up on CUDA.

All methods run on the engine thread; the API thread only constructs the object.
"""

from __future__ import annotations

import logging
import time

import torch

from ..device_io import to_device

log = logging.getLogger("sluice.structured")

# The masked-row counts warm-up compiles xgrammar's Triton kernel for: Triton specializes an int argument on
# being 1 and on being a multiple of 16, and the kernel takes the number of rows it masks, so each kind of
# batch has its own variant.
WARMUP_ROWS = (1, 2, 16)


def on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def bitmask_backend(device: torch.device) -> str:
    """xgrammar's kernel for logits on `device`. NOTE: named, never "auto": on CUDA its Triton one (an
    xgrammar that tries its nvcc-built CUDA kernel first would compile at the first grammar request, and a
    runtime image may have no nvcc); on CPU its own CPU one."""
    return "triton" if on_cuda(device) else "cpu"


def warm_up_bitmask(device: torch.device, vocab_size: int) -> None:
    """On CUDA, compile the masking kernel before any request (engine start-up, with the warm-up steps): one
    all-allowed bitmask applied to dummy logits as the sampler masks them (fp32 [rows, vocab]:
    LlamaForCausalLM.compute_logits), masking WARMUP_ROWS rows in turn. CPU: nothing to compile."""
    if not on_cuda(device):
        return
    try:
        import xgrammar as xgr
    except ImportError:
        log.warning("structured output: xgrammar is not installed; requests with a grammar will fail")
        return
    started = time.monotonic()
    rows = max(WARMUP_ROWS)
    logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
    bitmask = to_device(xgr.allocate_token_bitmask(rows, vocab_size), device)  # every bit set: all allowed
    for n in WARMUP_ROWS:
        indices = to_device(torch.arange(n, dtype=torch.int32), device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices, backend=bitmask_backend(device))
    log.info("structured output: %s masking kernel warmed for %s rows in %.1f s", bitmask_backend(device),
             "/".join(map(str, WARMUP_ROWS)), time.monotonic() - started)


class GrammarConstraint:
    __slots__ = ("matcher", "_stop_row")

    def __init__(self, compiled, stop_row: torch.Tensor):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self._stop_row = stop_row

    @staticmethod
    def stop_row(vocab_size: int, stop_token_ids: list[int]) -> torch.Tensor:
        """The bitmask row that allows only the stop tokens: what a grammar that has ended allows."""
        import xgrammar as xgr

        words = [0] * xgr.get_bitmask_shape(1, vocab_size)[1]
        for t in stop_token_ids:
            if t < vocab_size:
                words[t // 32] |= 1 << (t % 32)
        # Bit 31 set is a negative int32.
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    # -- TokenConstraint -----------------------------------------------------------------------
    def accept(self, token_id: int) -> None:
        m = self.matcher
        if m.is_terminated():
            return  # past the grammar's end (only with ignore_eos): stop tokens again, nothing to track
        if not m.accept_token(token_id):
            # The mask allowed only grammar tokens, so this means a bug, not bad user input: say so,
            # and keep serving (the request goes on unconstrained from the grammar's last state).
            log.error("grammar rejected emitted token %d; output may not match the grammar", token_id)

    def valid_prefix(self, token_ids: list[int]) -> int:
        m = self.matcher
        if m.is_terminated():
            return 0
        n = 0
        for t in token_ids:
            if not m.accept_token(t):
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    @classmethod
    def apply_batch(cls, logits: torch.Tensor, rows: list[tuple[int, GrammarConstraint, list[int]]]) -> None:
        """Fills one bitmask for every constrained row of the step, then masks them in one call.
        Row first + i is masked by the state after drafts[:i]: the drafts are accepted while
        filling and rolled back at the end, so each matcher ends where it started."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        indices: list[int] = []
        for first, c, drafts in rows:
            m = c.matcher
            accepted = 0
            for i in range(len(drafts) + 1):
                if m.is_terminated():
                    bitmask[first + i] = c._stop_row
                else:
                    m.fill_next_token_bitmask(bitmask, first + i)
                indices.append(first + i)
                # Drafts were cut to what the grammar accepts (engine._propose_drafts); should one
                # still fail, the rows after it keep this state's mask and the verifier rejects it.
                if i < len(drafts) and accepted == i and m.accept_token(drafts[i]):
                    accepted += 1
            if accepted:
                m.rollback(accepted)
        backend = bitmask_backend(logits.device)
        if backend == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices, backend=backend)
        else:
            # Both uploaded pinned and non-blocking: a list of indices would be copied up by xgrammar
            # from pageable memory, which waits for the forward still running (device_io.py).
            xgr.apply_token_bitmask_inplace(logits, to_device(bitmask, logits.device), backend=backend,
                                            indices=to_device(torch.tensor(indices, dtype=torch.int32), logits.device))
