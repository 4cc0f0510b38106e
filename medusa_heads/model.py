"""`MedusaModel`: a frozen backbone plus its heads, checked to fit each other."""

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from .attention import use_tree_gqa_attention
from .backbone import EMBEDDED_MODEL, first_line, load_backbone, parse_dtype, tap_features
from .compiled_llama import compile_fast_forward
from .config import MedusaConfig
from .errors import MedusaError
from .fast_llama import enable_fast_forward
from .formats import import_original, is_original_layout
from .head_types import head_type_class
from .heads import DraftHeads
from .ngram_store import NgramStore, find_store
from .packing import fuse_siblings, pack_linears
from .quantize import check_quantize, draft_weights_quantization, quantize_backbone, quantize_draft_weights

if TYPE_CHECKING:
    from peft import PeftConfig, PeftModel

logger = logging.getLogger(__name__)

# Heads shipped with the package, by backbone name.
SHIPPED_HEADS = {EMBEDDED_MODEL: Path(__file__).parent / "pretrained" / "smollm2-135m-embedded"}


def shipped_heads(base_model: str) -> Path | None:
    """The folder of the heads shipped for `base_model`, if the package has them."""
    folder = SHIPPED_HEADS.get(base_model)
    return folder if folder is not None and (folder / "config.json").is_file() else None


def load_heads(path: str | Path, dtype: torch.dtype | str | None = None) -> DraftHeads:
    """Load heads from a local folder or hub id; missing or unexpected weights are an error, not a warning. A folder
    in one of the original Medusa project's layouts (v0.1: `medusa_lm_head.safetensors`/`.pt`; v1.0: `medusa_head.*`
    weights in a whole model) is imported."""
    local = Path(path)
    if local.is_dir() and is_original_layout(local):
        return import_original(local, parse_dtype(dtype) if dtype is not None else None).eval()
    if local.exists() and not (local / "config.json").is_file():
        raise MedusaError(f"`{path}` holds no config.json: it is not a folder of Medusa heads.")
    if not local.exists() and (str(path).startswith((".", "/", "~")) or str(path).count("/") != 1):
        raise MedusaError(f"Heads folder `{path}` does not exist.")
    try:
        config = MedusaConfig.from_pretrained(path)
        extra = {"dtype": parse_dtype(dtype)} if dtype is not None else {}
        kind = head_type_class(config.head_type)
        heads, info = kind.from_pretrained(path, config=config, output_loading_info=True, use_kernels=False,
                                           **extra)  # no hub kernels, as load_backbone
    except (OSError, ValueError, StrictDataclassError, SafetensorError) as err:
        raise MedusaError(f"Cannot load Medusa heads from `{path}`: {first_line(err)}") from err
    bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        raise MedusaError(f"The weights in `{path}` do not match its config.json: {bad or info['error_msgs']}")
    return heads.eval()


def check_fits(heads: DraftHeads, backbone: PreTrainedModel) -> None:
    """Raise a MedusaError naming every size that differs between heads and backbone."""
    text_config = backbone.config.get_text_config()
    vocab = backbone.get_output_embeddings().weight.shape[0]
    problems = []
    if heads.config.hidden_size != text_config.hidden_size:
        problems.append(f"hidden size {heads.config.hidden_size} vs the backbone's {text_config.hidden_size}")
    if heads.config.vocab_size != vocab:
        problems.append(f"vocabulary {heads.config.vocab_size} vs the backbone's {vocab}")
    if problems:
        raise MedusaError(
            f"These heads do not fit this backbone ({'; '.join(problems)}); they were trained for "
            f"`{heads.config.base_model_name_or_path}`."
        )


def untrained_heads(backbone: PreTrainedModel, name_or_path: str, num_heads: int = 4, num_layers: int = 1,
                    share_lm_head: bool = True, gguf_file: str | None = None, head_type: str = "medusa",
                    draft_vocab: torch.Tensor | None = None, **config_fields) -> DraftHeads:
    """Fresh heads of `head_type` for `backbone`, starting from the backbone's own prediction (Medusa and Hydra
    heads are then exactly its LM head, restricted to `draft_vocab`, token ids the heads guess among, if given).
    `config_fields` override what the head type derives from the backbone (e.g. eagle3's `feature_layers`)."""
    kind = head_type_class(head_type)
    config = MedusaConfig(
        base_model_name_or_path=name_or_path,
        base_model_gguf_file=gguf_file,
        num_heads=num_heads,
        num_layers=num_layers,
        hidden_size=backbone.config.get_text_config().hidden_size,
        vocab_size=backbone.get_output_embeddings().weight.shape[0],
        share_lm_head=share_lm_head,
        head_type=head_type,
        draft_vocab_size=None if draft_vocab is None else int(draft_vocab.numel()),
        **(kind.config_fields_for(backbone.config) | config_fields),
    )
    heads = kind(config)
    if draft_vocab is not None:
        heads.set_draft_vocab(draft_vocab)
    heads.init_from_backbone(backbone)
    return heads.to(device=backbone.device, dtype=backbone.dtype)


ADAPTER_FOLDER = "adapter"  # where the LoRA adapter of Medusa-2 heads lives inside the heads folder


@dataclass
class Adapter:
    """A peft LoRA adapter trained with the heads (Medusa-2), kept after it was merged into the backbone so that
    `MedusaModel.save_pretrained` can write it again."""

    config: "PeftConfig"
    weights: dict[str, torch.Tensor]  # peft's saved keys (no adapter name), as `get_peft_model_state_dict` gives

    def save_pretrained(self, folder: str | Path) -> None:
        """Write it as peft does: `adapter_config.json` and `adapter_model.safetensors`."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(folder))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.weights.items()},
                  str(Path(folder) / "adapter_model.safetensors"), metadata={"format": "pt"})


def merge_adapter(adapted: "PeftModel") -> tuple[PreTrainedModel, Adapter]:
    """A peft model -> (its backbone with the adapter merged in: no extra cost per token, the adapter)."""
    from peft import get_peft_model_state_dict

    adapter = Adapter(adapted.peft_config[adapted.active_adapter],
                      {k: v.clone() for k, v in get_peft_model_state_dict(adapted).items()})
    return adapted.merge_and_unload().eval().requires_grad_(False), adapter


def load_adapter(backbone: PreTrainedModel, heads_path: str | Path,
                 subfolder: str) -> tuple[PreTrainedModel, Adapter]:
    """Merge the LoRA adapter saved with Medusa-2 heads into the backbone; returns it and the adapter."""
    from peft import PeftModel

    try:
        adapted = PeftModel.from_pretrained(backbone, str(heads_path), subfolder=subfolder)
    except (OSError, ValueError) as err:
        raise MedusaError(f"Cannot load the adapter `{subfolder}` saved with the heads `{heads_path}`: "
                          f"{first_line(err)}") from err
    return merge_adapter(adapted)


def save_heads(folder: str | Path, heads: DraftHeads, state_dict: dict | None = None, adapter=None,
               store: NgramStore | None = None) -> Path:
    r"""
    Write a heads folder, the one `load_heads` and `MedusaModel.from_pretrained` read: `config.json` and
    `model.safetensors`, the LoRA adapter in `adapter/` (anything with `save_pretrained(folder)`: an `Adapter` or a
    peft model) and the n-gram store. Written beside, then renamed: a failure leaves an existing folder whole.

    Args:
        state_dict: the heads' weights when they are not `heads.state_dict()` (gathered from ranks under ZeRO-3).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".tmp-{folder.name}-"))
    try:
        heads.config.base_model_adapter = ADAPTER_FOLDER if adapter is not None else None
        heads.save_pretrained(tmp, state_dict=state_dict)
        if adapter is not None:
            adapter.save_pretrained(tmp / ADAPTER_FOLDER)
        if store is not None:
            store.save(tmp)
        if folder.exists():
            old = folder.with_name(f".old-{folder.name}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old)
        else:
            os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@torch.no_grad()
def _trial_logits(backbone: PreTrainedModel) -> torch.Tensor:
    """The logits of a short forward without cache: what `fuse_siblings` traces and checks."""
    ids = torch.arange(1, 6, device=backbone.device)[None] % backbone.config.get_text_config().vocab_size
    return backbone(input_ids=ids, use_cache=False).logits


class MedusaModel(nn.Module):
    r"""
    A frozen backbone and its heads, ready for `medusa_heads.inference.generate`.

    Args:
        adapter: the LoRA adapter already merged into `backbone` (Medusa-2 heads), kept for `save_pretrained`.
        ngram_store: the n-gram store of the heads; None: read from the heads' folder when first asked for.

    Example:

    >>> model = MedusaModel.from_pretrained("path/to/heads")  # backbone named in the heads' config
    >>> model = MedusaModel.from_pretrained("path/to/heads", base_model="path/to/backbone", dtype="bfloat16")
    >>> model.save_pretrained("path/to/copy")  # heads, adapter and n-gram store; `from_pretrained` reads it back
    """

    def __init__(self, backbone: PreTrainedModel, heads: DraftHeads, adapter: Adapter | None = None,
                 ngram_store: NgramStore | None = None):
        super().__init__()
        check_fits(heads, backbone)
        self.backbone = backbone
        self.heads = heads
        self.adapter = adapter
        if heads.feature_layers:  # every forward of this backbone also returns the layers the heads read
            tap_features(backbone, heads.feature_layers)
        self._ngram_store = ngram_store
        self._store_looked_up = ngram_store is not None
        # Shared heads project with the backbone's LM head, or a copy of its draft-vocabulary rows.
        shared = heads.config.share_lm_head
        self.projection = heads.output_projection(backbone.get_output_embeddings()) if shared else None

    @property
    def ngram_store(self) -> NgramStore | None:
        """The n-gram store saved with the heads (loaded once), or None when they have none."""
        if not self._store_looked_up:  # once, found or not: a hub id without one costs a network round trip
            self._ngram_store = find_store(str(self.heads.name_or_path or ""))
            self._store_looked_up = True
        return self._ngram_store

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write the heads, their adapter and n-gram store: the exact inverse of `from_pretrained`."""
        if (kind := draft_weights_quantization(self)) != "none":
            raise MedusaError(f"These heads draft with {kind} weights (`quantize_drafter`), which would not load back as "
                              "heads: save the float heads they were loaded from.")
        return save_heads(folder, self.heads, adapter=self.adapter, store=self.ngram_store)

    @property
    def config(self) -> MedusaConfig:
        return self.heads.config

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    def require_heads(self, what: str) -> None:
        """Raise a one-line error when `what` needs heads that score any path from the last hidden state."""
        if self.heads.drafts_over_context:
            raise MedusaError(f"{what} needs heads that draft from the last hidden state alone (`--heads`); these are "
                              f"`{self.heads.head_type}` heads, which draft over the whole context.")

    def last_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last hidden state [..., H] of `backbone_forward`'s hidden states: a backbone tapped for an EAGLE-3
        drafter (`tap_features`) returns more layers after it."""
        return hidden[..., : self.config.hidden_size]

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Plain Medusa heads: hidden [..., H] (or a tapped backbone's wider states) -> logits [K, ..., V_out] over
        the heads' output vocabulary (`heads.token_ids` maps its indices to token ids)."""
        return self.heads(self.last_hidden(hidden), lm_head=self.projection)

    @torch.no_grad()
    def head_topk(self, hidden: torch.Tensor, paths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        r"""
        The heads' guesses for the children of N tree nodes of the same depth d (the root has depth 0).

        Args:
            hidden: [H], the last hidden state, the one that predicted the root (or a tapped backbone's wider
                states, of which the first H are read).
            paths: [N, d + 1] long, the tokens from the root down to each node.
            k: guesses per node.

        Returns:
            (tokens [N, k] long, logprobs [N, k] float): head d's top-k for the token after each node, best
            first, with their log-probabilities under the head. Plain Medusa heads ignore the path.
        """
        depth = paths.shape[1] - 1
        embeds = self.backbone.get_input_embeddings()(paths) if self.heads.reads_tokens else None  # [N, d + 1, H]
        states = self.heads.head_state(depth, self.last_hidden(hidden), embeds)
        logprobs = torch.log_softmax(self.heads.project(depth, states, self.projection).float(), -1)
        top = logprobs.topk(k)
        n = paths.shape[0]
        return self.heads.token_ids(top.indices).expand(n, k), top.values.expand(n, k)

    @classmethod
    def from_pretrained(
        cls,
        heads_path: str | Path | None = None,
        base_model: str | PreTrainedModel | None = None,
        dtype: str | torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        num_heads: int = 4,
        pack_weights: bool = True,
        quantize: str = "none",
        quantize_drafter: str = "none",
        fast_forward: bool = True,
        compile_step: bool | str = False,
    ) -> "MedusaModel":
        r"""
        Load backbone + heads.

        Args:
            heads_path: folder or hub id of saved heads. `None`: the heads shipped for `base_model` if there are
                any, else untrained heads (`num_heads` of them), which decode exactly but accept little.
            base_model: a loaded model, or a hub id / folder; `None` means the backbone named in the heads'
                config (or the embedded default when there are no heads either).
            dtype, device: where and how the backbone and heads run.
            pack_weights: on CPU, lay the linear weights out once for oneDNN (`packing.pack_linears`): faster,
                bit-identical in bf16, another rounding in fp32, one more copy of the weights in memory; the heads
                are then frozen (train them with the trainer, which loads them unpacked). Backbone
                layers reading the same input (q/k/v, gate/up) share one packed product (`packing.fuse_siblings`).
            quantize: `none`, `int8` or `int4`: the backbone's decoder computes with int8 or 4-bit weights
                (`quantize.py`, CPU only); packing then covers the layers left in float (the LM head).
            quantize_drafter: `none`, `int8` or `int4`: the same for the drafting weights (the heads' own layers and
                their draft-vocabulary projection; CPU only). Lossless: only the drafts change, the backbone verifies.
            fast_forward: decode a Llama-family backbone through `fast_llama.FastLlama` (the same function in fewer
                operations) instead of its modules; other architectures keep the modules whatever this says.
            compile_step: decode through the fast forward compiled (`compiled_llama.py`: about 40 s a step size the
                first time, then cached on disk; 1.2-1.3x faster steps on CPU). `auto`: where it pays, a CPU
                computing in bf16 (`parse_dtype`). fp32 steps compile too; their logits differ from the eager
                forward's in the last digits (about 1e-3), and greedy output matched HF's on the prompts tested.

        A backbone running transformers' `sdpa` attention switches to `sdpa_tree_gqa` (`attention.py`: tree steps
        read grouped key/value heads in place; bit-identical). These and `quantize` change a `base_model` passed in,
        in place.
        """
        dtype = parse_dtype(dtype, device)
        check_quantize(quantize, device)
        check_quantize(quantize_drafter, device)
        if heads_path is None and not isinstance(base_model, PreTrainedModel):
            heads_path = shipped_heads(base_model or EMBEDDED_MODEL)
        heads = load_heads(heads_path, dtype=dtype) if heads_path is not None else None
        if isinstance(base_model, PreTrainedModel):
            backbone, name, gguf = base_model, base_model.name_or_path, None
        else:
            name = base_model or (heads.config.base_model_name_or_path if heads else None) or EMBEDDED_MODEL
            gguf = heads.config.base_model_gguf_file if heads and not base_model else None
            backbone = load_backbone(name, gguf_file=gguf, dtype=dtype, device=device)
        adapter = None
        if heads is not None and heads.config.base_model_adapter:
            backbone, adapter = load_adapter(backbone, heads_path, heads.config.base_model_adapter)
        if heads is None:
            logger.warning("No trained heads for `%s`: using %d untrained heads (exact, but few tokens accepted).",
                           name, num_heads)
            heads = untrained_heads(backbone, name, num_heads=num_heads, gguf_file=gguf)
        quantize_backbone(backbone, quantize)  # after the adapter is merged into the float weights
        model = cls(backbone, heads.to(device=backbone.device, dtype=backbone.dtype), adapter)
        quantize_draft_weights(model, quantize_drafter)
        use_tree_gqa_attention(model.backbone)
        if pack_weights:
            model.heads.requires_grad_(False)  # a packed model decodes: its heads are frozen like the backbone
            pack_linears(model)
            fuse_siblings(model.backbone, partial(_trial_logits, model.backbone))
        if compile_step == "auto":
            compile_step = dtype == torch.bfloat16 and torch.device(device).type == "cpu"
        # after packing: it computes with the packed weights
        if fast_forward and enable_fast_forward(model.backbone) and compile_step:
            compile_fast_forward(model.backbone)
        return model
