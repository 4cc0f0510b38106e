"""`MedusaModel`: a frozen backbone plus its heads, checked to fit each other."""

import logging
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel

from .backbone import EMBEDDED_MODEL, first_line, load_backbone, parse_dtype
from .config import MedusaConfig
from .errors import MedusaError
from .eagle import EagleHead, decoder_config_for
from .heads import MedusaHeads

logger = logging.getLogger(__name__)

# Heads shipped with the package, by backbone name.
SHIPPED_HEADS = {EMBEDDED_MODEL: Path(__file__).parent / "pretrained" / "smollm2-135m-embedded"}


def shipped_heads(base_model: str) -> Path | None:
    """The folder of the heads shipped for `base_model`, if the package has them."""
    folder = SHIPPED_HEADS.get(base_model)
    return folder if folder is not None and (folder / "config.json").is_file() else None


def load_heads(path: str | Path, dtype: torch.dtype | str | None = None) -> MedusaHeads | EagleHead:
    """Load heads from a local folder or hub id; missing or unexpected weights are an error, not a warning."""
    local = Path(path)
    if local.exists() and not (local / "config.json").is_file():
        raise MedusaError(f"`{path}` holds no config.json: it is not a folder of Medusa heads.")
    if not local.exists() and (str(path).startswith((".", "/", "~")) or str(path).count("/") != 1):
        raise MedusaError(f"Heads folder `{path}` does not exist.")
    try:
        config = MedusaConfig.from_pretrained(path)
        extra = {"dtype": parse_dtype(dtype)} if dtype is not None else {}
        kind = EagleHead if config.head_type == "eagle" else MedusaHeads
        heads, info = kind.from_pretrained(path, config=config, output_loading_info=True, **extra)
    except (OSError, ValueError, StrictDataclassError, SafetensorError) as err:
        raise MedusaError(f"Cannot load Medusa heads from `{path}`: {first_line(err)}") from err
    bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        raise MedusaError(f"The weights in `{path}` do not match its config.json: {bad or info['error_msgs']}")
    return heads.eval()


def check_fits(heads: MedusaHeads | EagleHead, backbone: PreTrainedModel) -> None:
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
                    draft_vocab: torch.Tensor | None = None) -> MedusaHeads | EagleHead:
    """Fresh heads for `backbone`: each starts as exactly the backbone's LM head (restricted to `draft_vocab`,
    token ids the heads guess among, when given). `head_type="eagle"`: a fresh one-layer drafter instead."""
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
        decoder_config=decoder_config_for(backbone.config) if head_type == "eagle" else None,
    )
    heads = EagleHead(config) if head_type == "eagle" else MedusaHeads(config)
    if head_type == "eagle":
        heads.init_as_identity()
    if draft_vocab is not None:
        heads.set_draft_vocab(draft_vocab)
    if not share_lm_head:
        heads.init_lm_heads_from(backbone.get_output_embeddings())
    return heads.to(device=backbone.device, dtype=backbone.dtype)


def apply_adapter(backbone: PreTrainedModel, heads_path: str | Path, subfolder: str) -> PreTrainedModel:
    """Merge the LoRA adapter saved with Medusa-2 heads into the backbone (merged: no extra cost per token)."""
    from peft import PeftModel

    try:
        adapted = PeftModel.from_pretrained(backbone, str(heads_path), subfolder=subfolder)
    except (OSError, ValueError) as err:
        raise MedusaError(f"Cannot load the adapter `{subfolder}` saved with the heads `{heads_path}`: "
                          f"{first_line(err)}") from err
    return adapted.merge_and_unload().eval().requires_grad_(False)


class MedusaModel(nn.Module):
    r"""
    A frozen backbone and its Medusa heads, ready for `medusa_heads.inference.generate`.

    Example:

    >>> model = MedusaModel.from_pretrained("path/to/heads")  # backbone named in the heads' config
    >>> model = MedusaModel.from_pretrained("path/to/heads", base_model="path/to/backbone", dtype="bfloat16")
    """

    def __init__(self, backbone: PreTrainedModel, heads: MedusaHeads | EagleHead):
        super().__init__()
        check_fits(heads, backbone)
        self.backbone = backbone
        self.heads = heads
        # Shared heads project with the backbone's LM head, or a copy of its draft-vocabulary rows.
        self.projection = heads.output_projection(backbone.get_output_embeddings()) if heads.lm_heads is None else None

    @property
    def config(self) -> MedusaConfig:
        return self.heads.config

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    @property
    def is_eagle(self) -> bool:
        """A one-layer drafter over the context (`EagleHead`) rather than heads on the last hidden state."""
        return isinstance(self.heads, EagleHead)

    def require_heads(self, what: str) -> None:
        """Raise a one-line error when `what` needs heads that draft from the last hidden state alone."""
        if self.is_eagle:
            raise MedusaError(f"{what} needs Medusa or Hydra heads (`--heads`); these are an EAGLE drafter, which "
                              "drafts static trees only.")

    @torch.no_grad()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Plain Medusa heads: hidden [..., H] -> logits [K, ..., V_out] over the heads' output vocabulary
        (`heads.token_ids` maps its indices to token ids)."""
        return self.heads(hidden, lm_head=self.projection)

    @torch.no_grad()
    def head_topk(self, hidden: torch.Tensor, paths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        r"""
        The heads' guesses for the children of N tree nodes of the same depth d (the root has depth 0).

        Args:
            hidden: [H], the last hidden state, the one that predicted the root.
            paths: [N, d + 1] long, the tokens from the root down to each node.
            k: guesses per node.

        Returns:
            (tokens [N, k] long, logprobs [N, k] float): head d's top-k for the token after each node, best
            first, with their log-probabilities under the head. Plain Medusa heads ignore the path.
        """
        depth = paths.shape[1] - 1
        embeds = self.backbone.get_input_embeddings()(paths) if self.heads.is_hydra else None  # [N, d + 1, H]
        states = self.heads.head_state(depth, hidden, embeds)
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
    ) -> "MedusaModel":
        r"""
        Load backbone + heads.

        Args:
            heads_path: folder or hub id of saved heads. `None`: the heads shipped for `base_model` if there are
                any, else untrained heads (`num_heads` of them), which decode exactly but accept little.
            base_model: a loaded model, or a hub id / folder; `None` means the backbone named in the heads'
                config (or the embedded default when there are no heads either).
            dtype, device: where and how the backbone and heads run.
        """
        dtype = parse_dtype(dtype)
        if heads_path is None and not isinstance(base_model, PreTrainedModel):
            heads_path = shipped_heads(base_model or EMBEDDED_MODEL)
        heads = load_heads(heads_path, dtype=dtype) if heads_path is not None else None
        if isinstance(base_model, PreTrainedModel):
            backbone, name, gguf = base_model, base_model.name_or_path, None
        else:
            name = base_model or (heads.config.base_model_name_or_path if heads else None) or EMBEDDED_MODEL
            gguf = heads.config.base_model_gguf_file if heads and not base_model else None
            backbone = load_backbone(name, gguf_file=gguf, dtype=dtype, device=device)
        if heads is not None and heads.config.base_model_adapter:
            backbone = apply_adapter(backbone, heads_path, heads.config.base_model_adapter)
        if heads is None:
            logger.warning("No trained heads for `%s`: using %d untrained heads (exact, but few tokens accepted).",
                           name, num_heads)
            heads = untrained_heads(backbone, name, num_heads=num_heads, gguf_file=gguf)
        return cls(backbone, heads.to(device=backbone.device, dtype=backbone.dtype))
