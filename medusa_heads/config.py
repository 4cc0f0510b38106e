"""`MedusaConfig`: what a set of Medusa heads is, saved as `config.json` beside the weights."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig

FORMAT_VERSION = 4  # 2: `head_type` and `draft_vocab_size`; 3: `head_type="eagle"` and `decoder_config`;
# 4: `head_type="eagle3"` and `feature_layers`


@strict(accept_kwargs=True)
class MedusaConfig(PreTrainedConfig):
    r"""
    Configuration of K Medusa heads on top of a causal LM backbone.

    Args:
        base_model_name_or_path (`str`):
            Hub id, local folder or embedded alias of the backbone the heads were trained on.
        base_model_gguf_file (`str`, *optional*):
            GGUF file name inside `base_model_name_or_path`, when the backbone is loaded from GGUF.
        base_model_adapter (`str`, *optional*):
            Subfolder of the heads holding a peft LoRA adapter trained with them (Medusa-2); loading applies it.
        num_heads (`int`, defaults to 4):
            Number of heads K; head k (0-based) predicts the token k + 2 positions after the hidden state.
        num_layers (`int`, defaults to 1):
            Residual blocks `h + SiLU(W h + b)` per head.
        hidden_size (`int`):
            Hidden size of the backbone's last hidden state.
        vocab_size (`int`):
            Size of the backbone's output vocabulary.
        share_lm_head (`bool`, defaults to `True`):
            If `True` every head projects with the backbone's own LM head (not saved with the heads);
            if `False` each head owns a projection, initialised from the backbone's (as in the Medusa paper).
        head_type (`str`, defaults to `"medusa"`):
            A name in `medusa_heads.head_types.HEAD_TYPES`: `"medusa"` (`MedusaHeads`, each head reads only the
            hidden state), `"hydra"` (`HydraHeads`, head k also reads the embeddings of the k tokens before its own
            on the draft path), `"eagle"` (`EagleHead`, one decoder layer over the backbone's features and
            tokens of the whole context, drafting `num_heads` deep, one depth per call) or `"eagle3"`
            (`Eagle3Head`, the same over a fusion of several layers' features, with its own LM head).
        draft_vocab_size (`int`, *optional*):
            Heads guess among this many tokens only (the most frequent in the training targets, saved as the
            `draft_vocab` buffer): a cheaper projection. Verification still uses the full vocabulary.
        decoder_config (`dict`, *optional*):
            For `head_type="eagle"` and `"eagle3"`: the config (as a dict) of the one-layer decoder, the
            backbone's own with `num_hidden_layers=1`.
        feature_layers (`list[int]`, *optional*):
            For `head_type="eagle3"`: the backbone's decoder layers whose inputs it fuses (increasing ids; layer i's
            input is layer i - 1's output), by default a low, a middle and a high one (2, 15, 27 of 30).
        format_version (`int`):
            Version of the saved format, checked on load.

    Example:

    >>> config = MedusaConfig(base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct", hidden_size=576, vocab_size=49152)
    >>> config.num_heads
    4
    """

    model_type = "medusa_heads"

    base_model_name_or_path: str | None = None
    base_model_gguf_file: str | None = None
    base_model_adapter: str | None = None
    num_heads: int = 4
    num_layers: int = 1
    hidden_size: int = 576
    vocab_size: int = 49152
    share_lm_head: bool = True
    head_type: str = "medusa"
    draft_vocab_size: int | None = None
    decoder_config: dict | None = None
    feature_layers: list[int] | None = None
    format_version: int = FORMAT_VERSION

    def validate_architecture(self):
        """Called by `@strict` on construction: one sentence per problem, naming the argument. What a head type
        needs beyond this is checked by its class (`DraftHeads.check_config`), which knows the type."""
        if self.num_heads < 1:
            raise ValueError(f"`num_heads` must be at least 1, got {self.num_heads}.")
        if self.num_layers < 0:
            raise ValueError(f"`num_layers` must be 0 or more, got {self.num_layers}.")
        if self.hidden_size < 1 or self.vocab_size < 1:
            raise ValueError(
                f"`hidden_size` and `vocab_size` must be positive, got {self.hidden_size} and {self.vocab_size}."
            )
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"`draft_vocab_size` must be in 1..vocab_size ({self.vocab_size}), got {self.draft_vocab_size}."
            )
        if self.format_version > FORMAT_VERSION:
            raise ValueError(
                f"These heads use format version {self.format_version}, newer than this medusa-heads "
                f"({FORMAT_VERSION}); please upgrade medusa-heads."
            )
