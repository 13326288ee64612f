"""GPU-quantized checkpoints (AWQ, GPTQ with and without act-order, FP8 per-tensor and per-channel) served by the
whole engine: tiny random 2-layer models written quantized and as their dequantized dense twins (the same
architecture, each dense weight the exact dequantized one), both loaded through `LLM`; the quantized model's
decoder projections must be QuantLinear over the format's weights (dequantizing to the twin's weights exactly,
fused q/k/v and gate/up included), and the two must generate the same greedy tokens with close logprobs.
Also: the refusals (a format that is not the checkpoint's; GPU formats on the CPU path), `--quantization fp8`
on a dense checkpoint (quantized at load), and the tensor- and pipeline-parallel shards of the quantized
projections against the twin's.

Without a GPU everything runs in Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported,
see triton_interpreter.py) with --attention-backend triton, in fp32. Tolerances: quantized and dense run the
same fp32 products (the kernels dequantize exactly and dot in IEEE fp32), summed in another order, so the
sampled tokens' logprobs agree to 1e-4 (observed ~1e-6).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from quant_checkpoints import awq_layer, fp8_layer, gptq_layer, write_checkpoint  # noqa: E402
from triton_interpreter import import_kernels  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

import_kernels("sluice_engine.quant.triton_gemm")
import_kernels("sluice_engine.attention.triton_kernels")
import_kernels("sluice_engine.layer_ops.triton_kernels")
from sluice_engine.config import EngineConfig  # noqa: E402
from sluice_engine.entrypoints.llm import LLM  # noqa: E402
from sluice_engine.quant.awq import AwqWeights  # noqa: E402
from sluice_engine.quant.fp8 import Fp8Weights, quantize_fp8  # noqa: E402
from sluice_engine.quant.gptq import GptqWeights  # noqa: E402
from sluice_engine.quant.linear import ConcatQuantLinear, QuantLinear  # noqa: E402
from sluice_engine.sampling_params import SamplingParams  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB, GROUP = 64, 128, 4, 2, 16, 2, 96, 32
PROJ = {"self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM), "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
        "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
        "mlp.gate_proj": (HIDDEN, INTER), "mlp.up_proj": (HIDDEN, INTER), "mlp.down_proj": (INTER, HIDDEN)}  # K, N
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}
WEIGHTS = {"awq": AwqWeights, "gptq": GptqWeights, "fp8": Fp8Weights}
# Each case: (method, architecture, its quantization_config).
CASES = {
    "awq": ("awq", "Qwen2ForCausalLM",  # q/k/v bias: concatenated beside the packed weights
            {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}),
    "gptq": ("gptq", "LlamaForCausalLM",
             {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq"}),
    "gptq-act-order": ("gptq", "LlamaForCausalLM",
                       {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
                        "checkpoint_format": "gptq"}),
    "fp8-per-tensor": ("fp8", "LlamaForCausalLM", {"quant_method": "fp8", "activation_scheme": "static"}),
    "fp8-per-channel": ("fp8", "LlamaForCausalLM",  # layer 1's down_proj kept dense (ignored_layers)
                        {"quant_method": "fp8", "activation_scheme": "dynamic",
                         "ignored_layers": ["lm_head", "model.layers.1.mlp.down_proj"]}),
}
DENSE_LAYER = ("fp8-per-channel", 1, "mlp.down_proj")


pytestmark = pytest.mark.usefixtures("one_thread")


def _config(arch: str) -> dict:
    return dict(architectures=[arch], vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                head_dim=HEAD_DIM, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)


def _tokenizer(root) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))


def _dense_tensors(gen: torch.Generator, arch: str) -> dict[str, torch.Tensor]:
    """Embeddings, norms, output layer (and Qwen2's q/k/v biases): dense in both checkpoints, stored in fp16
    as quantized checkpoints keep them."""
    def w(*shape, std=0.2):
        return (torch.randn(*shape, generator=gen) * std).half()

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, std=1.0), "lm_head.weight": w(VOCAB, HIDDEN),
         "model.norm.weight": 1 + w(HIDDEN, std=0.1)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": 1 + w(HIDDEN, std=0.1),
              p + "post_attention_layernorm.weight": 1 + w(HIDDEN, std=0.1)}
        if arch == "Qwen2ForCausalLM":
            for proj in ("q_proj", "k_proj", "v_proj"):
                t[f"{p}self_attn.{proj}.bias"] = w(PROJ[f"self_attn.{proj}"][1], std=0.1)
    return t


def _write_pair(root, case: str):
    """(quantized dir, dense twin dir, {checkpoint prefix: twin W [N, K]})."""
    method, arch, qcfg = CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    shared = _dense_tensors(gen, arch)
    quant, dense, twins = dict(shared), dict(shared), {}
    for i in range(LAYERS):
        # act-order: the parts of a fused projection quantized from one input share one g_idx -- except
        # layer 1's q/k/v, given their own (they run side by side).
        perms = {}
        for name, (k, n) in PROJ.items():
            prefix = f"model.layers.{i}.{name}."
            if (case, i, name) == DENSE_LAYER:
                dense[prefix + "weight"] = quant[prefix + "weight"] = (torch.randn(n, k, generator=gen) * 0.1).half()
                continue
            if method == "awq":
                tensors, w = awq_layer(k, n, GROUP, gen, scale=2.5)
            elif method == "gptq":
                g_idx = None
                if case == "gptq-act-order":
                    key = name if (i == 1 and name.startswith("self_attn")) else (name.split(".")[0], k)
                    if key not in perms:
                        perms[key] = torch.randperm(k, generator=gen) // GROUP
                    g_idx = perms[key]
                tensors, w = gptq_layer(k, n, GROUP, gen, g_idx, scale=2.5)
            else:
                tensors, w = fp8_layer(k, n, gen, per_channel=case == "fp8-per-channel", std=0.2)
                tensors["input_scale"] = torch.tensor(0.02)  # static activation scales: not used (W8A16)
            quant |= {prefix + suffix: t for suffix, t in tensors.items()}
            dense[prefix + "weight"] = w
            twins[prefix] = w
    write_checkpoint(root / "quant", {**_config(arch), "quantization_config": qcfg}, quant)
    write_checkpoint(root / "dense", _config(arch), dense, shards=1)
    for d in ("quant", "dense"):
        _tokenizer(root / d)
    return root / "quant", root / "dense", twins


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("attention_backend", "triton")
    return LLM(str(model_dir), device=DEVICE, dtype="float32", block_size=4, kv_cache_memory=1 << 20,
               max_num_seqs=4, **kw)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 11)]


PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


def _dequantized(module) -> torch.Tensor:
    """The module's weight as nn.Linear holds it, [N, K]."""
    if isinstance(module, ConcatQuantLinear):
        return torch.cat([_dequantized(p) for p in module.parts])
    w = module.weights.dequantize()
    return w if isinstance(module.weights, Fp8Weights) else w.T


def _same_generations(got, want) -> None:
    assert len({t for c in want for t in c.token_ids}) > 3  # the random model does not repeat one token
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for gl, wl in zip(g.logprobs, w.logprobs, strict=True):
            assert abs(gl[0] - wl[0]) < 1e-4  # the sampled token's logprob
            assert [i for i, _ in gl[1]] == [i for i, _ in wl[1]]  # the top 3, in order
            assert max(abs(a - b) for (_, a), (_, b) in zip(gl[1], wl[1], strict=True)) < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_generates_as_its_dequantized_twin(tmp_path, case):
    method = CASES[case][0]
    qdir, ddir, twins = _write_pair(tmp_path, case)
    quant = _llm(qdir)  # --quantization auto: the checkpoint's format
    assert quant.engine.runner.quantization == method
    dense = _llm(ddir)
    qmodel, dmodel = quant.engine.runner.model, dense.engine.runner.model
    side_by_side = 0
    for i in range(LAYERS):
        for module, parts in FUSED.items():
            q = qmodel.layers[i].get_submodule(module)
            d = dmodel.layers[i].get_submodule(module)
            if (case, i, module) == DENSE_LAYER:
                assert type(q) is torch.nn.Linear and torch.equal(q.weight, d.weight)
                continue
            if isinstance(q, ConcatQuantLinear):
                side_by_side += 1
                assert all(isinstance(p.weights, WEIGHTS[method]) for p in q.parts)
            else:
                assert isinstance(q, QuantLinear) and isinstance(q.weights, WEIGHTS[method]), type(q)
            assert torch.equal(_dequantized(q), d.weight), (i, module)
            want = torch.cat([twins[f"model.layers.{i}.{p}."] for p in parts]).to(d.weight.device)  # CPU-built
            assert torch.equal(d.weight, want)
            if d.bias is not None:
                assert torch.equal(_bias(q), d.bias)
    # Only act-order layer 1's q/k/v have g_idx that differ: the one projection run as separate calls.
    assert side_by_side == (1 if case == "gptq-act-order" else 0)
    if case == "fp8-per-tensor":  # q/k/v's different scales became per-channel; o_proj's one stays one
        assert qmodel.layers[0].self_attn.qkv_proj.weights.per_channel
        assert not qmodel.layers[0].self_attn.o_proj.weights.per_channel
    _same_generations(quant.generate(_prompts(), PARAMS), dense.generate(_prompts(), PARAMS))


def _bias(module) -> torch.Tensor:
    if isinstance(module, ConcatQuantLinear):
        return torch.cat([p.bias for p in module.parts])
    return module.bias


@pytest.fixture(scope="module")
def gptq_pair(tmp_path_factory):
    return _write_pair(tmp_path_factory.mktemp("gptq"), "gptq")


def test_a_format_that_is_not_the_checkpoints_is_refused(gptq_pair):
    qdir, ddir, _ = gptq_pair
    for flag in ("awq", "fp8", "none"):
        with pytest.raises(ValueError, match=f"--quantization {flag}: the checkpoint is gptq-quantized .*"
                                             "auto or gptq"):
            _llm(qdir, quantization=flag)
    with pytest.raises(ValueError, match="--quantization awq serves awq checkpoints .* this checkpoint is dense"):
        _llm(ddir, quantization="awq")
    # The GPU formats off the Triton path: named by the flag, or by the checkpoint under auto.
    with pytest.raises(ValueError, match="gptq weights need CUDA kernels; on CPU"):
        EngineConfig(device="cpu", quantization="gptq")
    EngineConfig(device="cpu", quantization="gptq", attention_backend="triton")  # the interpreter: tests
    if not CUDA:
        with pytest.raises(ValueError, match="the checkpoint is gptq-quantized .* need CUDA kernels .*not cpu"):
            _llm(qdir, attention_backend="torch")


def _exact_fp8_dense(root):
    """A dense checkpoint whose projections quantize to per-channel FP8 exactly: e4m3 values, each row's
    largest 448, times a power of two (then absmax / 448 is that power, and w / scale the e4m3 value)."""
    gen = torch.Generator().manual_seed(21)
    tensors = {k: v.float() for k, v in _dense_tensors(gen, "LlamaForCausalLM").items()}
    for i in range(LAYERS):
        for name, (k, n) in PROJ.items():
            q = (torch.randn(n, k, generator=gen) * 120).clamp(-440, 440).to(torch.float8_e4m3fn).float()
            q[:, 0] = 448.0
            tensors[f"model.layers.{i}.{name}.weight"] = q * 2.0 ** -torch.randint(10, 12, (n, 1), generator=gen)
    write_checkpoint(root, _config("LlamaForCausalLM"), tensors, shards=1)
    _tokenizer(root)
    return root


def test_fp8_on_a_dense_checkpoint_quantizes_at_load(tmp_path):
    model_dir = _exact_fp8_dense(tmp_path)
    fp8 = _llm(model_dir, quantization="fp8")
    dense = _llm(model_dir)
    assert fp8.engine.runner.quantization == "fp8" and dense.engine.runner.quantization == "none"
    for layer, ref in zip(fp8.engine.runner.model.layers, dense.engine.runner.model.layers, strict=True):
        for module in FUSED:
            q, d = layer.get_submodule(module), ref.get_submodule(module)
            assert isinstance(q, QuantLinear) and q.weights.per_channel
            wq, scale = quantize_fp8(d.weight, per_channel=True)
            assert torch.equal(q.weights.weight.view(torch.uint8), wq.view(torch.uint8))
            assert torch.equal(q.weights.weight_scale, scale)
            assert torch.equal(_dequantized(q), d.weight)  # exact for these weights (see _exact_fp8_dense)
    _same_generations(fp8.generate(_prompts(), PARAMS), dense.generate(_prompts(), PARAMS))


@pytest.mark.parametrize("case", ["awq", "gptq-act-order", "fp8-per-tensor"])
def test_tensor_and_pipeline_shards_are_the_twins(tmp_path, case):
    """tp 2 x pp 2: each rank's quantized projections (column-parallel qkv/gate_up split along N,
    row-parallel o/down along K) dequantize to the dense twin's shard on that rank. Only loading: no
    collective runs."""
    from sluice_engine.attention.triton_paged import TritonPagedAttention
    from sluice_engine.distributed.layout import rank_shard
    from sluice_engine.model_config import ModelConfig
    from sluice_engine.models.loader import load_model

    qdir, ddir, _ = _write_pair(tmp_path, case)
    mc = ModelConfig.from_dir(qdir)
    backend = TritonPagedAttention(torch.device(DEVICE))
    method = CASES[case][0]
    for rank in range(4):
        shard = rank_shard(mc, 2, 2, rank)
        quant = load_model(qdir, mc, backend, torch.device(DEVICE), torch.float32, 64, shard, quantization=method)
        dense = load_model(ddir, mc, backend, torch.device(DEVICE), torch.float32, 64, shard)
        assert len(quant.layers) == 1
        for module in FUSED:
            q, d = quant.layers[0].get_submodule(module), dense.layers[0].get_submodule(module)
            assert isinstance(q, QuantLinear | ConcatQuantLinear)
            assert torch.equal(_dequantized(q), d.weight), (rank, module)
            if d.bias is not None:
                assert torch.equal(_bias(q), d.bias)


def test_row_parallel_split_off_the_awq_groups_is_refused(tmp_path):
    from sluice_engine.attention.triton_paged import TritonPagedAttention
    from sluice_engine.distributed.layout import rank_shard
    from sluice_engine.model_config import ModelConfig
    from sluice_engine.models.loader import load_model

    gen = torch.Generator().manual_seed(3)
    tensors = _dense_tensors(gen, "LlamaForCausalLM")
    for i in range(LAYERS):
        for name, (k, n) in PROJ.items():
            packed, _ = awq_layer(k, n, 64, gen)
            tensors |= {f"model.layers.{i}.{name}.{s}": t for s, t in packed.items()}
    write_checkpoint(tmp_path, {**_config("LlamaForCausalLM"), "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}}, tensors)
    mc = ModelConfig.from_dir(tmp_path)
    with pytest.raises(ValueError, match="--quantization awq with --tensor-parallel-size 2: "
                                         "model.layers.0.self_attn.o_proj.: .*group boundaries"):
        load_model(tmp_path, mc, TritonPagedAttention(torch.device(DEVICE)), torch.device(DEVICE), torch.float32,
                   64, rank_shard(mc, 2, 1, 0), quantization="awq")


def test_a_quantized_draft_model_is_served_in_its_format(gptq_pair):
    """--draft-model on a quantized checkpoint: the draft's projections are QuantLinear too, and greedy
    speculative decoding gives the target's own greedy tokens (here the draft is the target's quantized
    twin, so most drafts are accepted)."""
    qdir, ddir, _ = gptq_pair
    want = _llm(ddir).generate(_prompts(), PARAMS)
    spec = _llm(ddir, draft_model=str(qdir), num_speculative_tokens=2)
    draft = spec.engine.proposer.model
    assert isinstance(draft.layers[0].mlp.down_proj.weights, GptqWeights)
    got = spec.generate(_prompts(), PARAMS)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
