"""What crosses between the API process and the engine-core process: plain typed structs, msgpack-encoded.

The API process sends commands (add, abort, shutdown); the core answers with one `CoreOutputs` per step
(the step's output deltas, the requests it refused, and its stats snapshot) and a few lifecycle messages
(ready, warmed up, dead). Nothing pickled crosses: a message decodes only into the types named here, so
a core and an API process of different builds fail loudly at the first message instead of misreading it.

Exceptions cannot cross as objects: a refused add travels as `AddRefused` (kind, message, the request field
it names) and is raised again on the API side as the same exception class (`refusal_error`).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from ..metrics import Histogram, StatsSnapshot
from ..sampling_params import InvalidParam, SamplingParams
from ..structured.grammar import GrammarError, GrammarSpec
from .model_info import ModelInfo, RequestRejected
from .output import RequestOutput


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (its own fault); the engine serves on."""


# -- API process -> core -----------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the API took it (one clock for every process of the host)
    grammar: GrammarSpec | None = None  # the core compiles it (cached) into the request's token constraint
    lora_name: str | None = None  # the LoRA adapter the request runs on (None: the base model)
    kv_push_to: str | None = None  # host:port: where its prompt's KV blocks go when it finishes (kv_transfer/)
    priority: int = 0  # --scheduling-policy priority: lower is served earlier


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    request_id: str
    client_left_at: float | None = None  # time.monotonic() the API noticed its client leave


class FinishRequest(msgspec.Struct, tag="finish", array_like=True):
    """The request's text reached a stop string (the API process's output processor found it): finish it."""

    request_id: str
    stop_string: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class LoadLoRA(msgspec.Struct, tag="load_lora", array_like=True):
    """Serve the PEFT adapter in `path` as model `name` (POST /v1/load_lora_adapter): answered by LoRAUpdated."""

    call_id: str
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag="unload_lora", array_like=True):
    call_id: str
    name: str


Command = AddRequest | AbortRequest | FinishRequest | Shutdown | LoadLoRA | UnloadLoRA


# -- core -> API process -----------------------------------------------------------------------------
class AddRefused(msgspec.Struct, array_like=True):
    """An add the core would not take: `kind` names the exception class the API raises again."""

    request_id: str
    kind: str  # rejected | invalid_param | grammar | invalid | failed
    message: str
    param: str | None = None
    code: str | None = None


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[RequestOutput]
    refused: list[AddRefused]
    stats: StatsSnapshot | None  # published before the outputs are handed out: a client sees its answer counted


class LoRAUpdated(msgspec.Struct, tag="lora", array_like=True):
    """The adapters served now, after a load or unload: the answer to LoadLoRA / UnloadLoRA (call_id), or the
    core's own change from --lora-modules-file (call_id None). error: why the call did nothing (kind
    "invalid": a 400, "not_found": a 404)."""

    call_id: str | None
    lora_names: list[str]
    error: str | None = None
    error_kind: str | None = None
    error_param: str | None = None  # the request field the error is about (lora_name, lora_path)
    message: str = ""


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    """The model is loaded and the KV cache sized; warm-up follows (CoreWarmedUp)."""

    served_model_name: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    stats: StatsSnapshot
    lora_names: list[str] = []

    def model_info(self) -> ModelInfo:
        return ModelInfo(self.served_model_name, Path(self.model_dir), self.max_model_len, self.vocab_size,
                         frozenset(self.eos_token_ids), tuple(self.lora_names))


class CoreWarmedUp(msgspec.Struct, tag="warmed_up", array_like=True):
    mode: str
    steps: int
    seconds: float


class CoreDead(msgspec.Struct, tag="dead", array_like=True):
    """The core cannot serve (its loop failed, a rank was lost, the model did not load): it exits after this."""

    error: str
    config_error: bool = False  # the flags do not work (a ValueError at start): `sluice serve` says so, exit 2


CoreMessage = CoreOutputs | CoreReady | CoreWarmedUp | CoreDead | LoRAUpdated


# -- encoding ----------------------------------------------------------------------------------------
def _enc_hook(obj):
    if isinstance(obj, Histogram):
        return (obj.bounds, obj.counts, obj.sum)
    if isinstance(obj, frozenset):
        return sorted(obj)
    raise NotImplementedError(f"{type(obj).__name__} does not cross between the API and the core")


def _dec_hook(type_, obj):
    if type_ is Histogram:
        bounds, counts, total = obj
        h = Histogram.__new__(Histogram)
        h.bounds, h.counts, h.sum = tuple(bounds), list(counts), float(total)
        return h
    raise NotImplementedError(f"cannot decode {type_}")


def command_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook), msgspec.msgpack.Decoder(Command, dec_hook=_dec_hook)


def core_message_codec() -> tuple[msgspec.msgpack.Encoder, msgspec.msgpack.Decoder]:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook), msgspec.msgpack.Decoder(CoreMessage, dec_hook=_dec_hook)


# -- refusals ----------------------------------------------------------------------------------------
def refusal(request_id: str, e: BaseException) -> AddRefused:
    if isinstance(e, RequestRejected):
        return AddRefused(request_id, "rejected", str(e), e.param, e.code)
    if isinstance(e, InvalidParam):
        return AddRefused(request_id, "invalid_param", str(e), e.param)
    if isinstance(e, GrammarError):  # the core's compile failed or ran past its deadline: a 400 naming the field
        return AddRefused(request_id, "grammar", str(e), e.param)
    if isinstance(e, ValueError):
        return AddRefused(request_id, "invalid", str(e), getattr(e, "param", None))
    return AddRefused(request_id, "failed", f"request failed in the engine: {e!r}")


def refusal_error(r: AddRefused) -> Exception:
    """The exception the API raises for a refused add: the class the core raised, with its field and code."""
    if r.kind == "rejected":
        return RequestRejected(r.param or "prompt", r.message, r.code or "invalid_value")
    if r.kind == "invalid_param":
        return InvalidParam(r.param or "", r.message)
    if r.kind == "grammar":
        return GrammarError(r.message, param=r.param)
    if r.kind == "invalid":
        return ValueError(r.message)
    return RequestFailedError(r.message)
