r"""
The registry of drafters and acceptance rules: the one place that lists them.

The CLI's `--drafter` and `--acceptance` choices, the bench's method names (`NAME[:FIELD...][:RULE@T]`) and
`make_drafter` / `make_acceptance` all read these tables. Adding a drafter means writing its class (under
`drafters/`) and one `DrafterSpec` here.
"""

from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Callable

import torch

from medusa_heads.backbone import load_backbone
from medusa_heads.errors import MedusaError, read_json
from medusa_heads.fast_eagle3 import fast_eagle3_supports
from medusa_heads.model import MedusaModel
from medusa_heads.ngram_store import STORE_FILE, NgramStore
from medusa_heads.tree import TreeBuffers, build_tree, load_tree

from .acceptance import ExactAcceptance, GreedyAcceptance, TypicalAcceptance
from .draft import Acceptance, Drafter
from .drafters.draft_model import DraftModelDrafter, EarlyExitDrafter
from .drafters.dynamic import AdaptiveDrafter, DynamicDrafter
from .drafters.eagle import EagleDrafter
from .drafters.eagle3_tree import Eagle3TreeDrafter
from .drafters.heads import MedusaDrafter
from .drafters.ngram import DynamicNgramDrafter, MedusaNgramDrafter, NgramDrafter
from .drafters.plain import PlainDrafter
from .tuned import tuned_choice

DEFAULT_TREE = "cpu-8"

# What each option is, for error messages and the bench's method fields.
OPTIONS = {
    "tree": "a shipped tree name or a JSON file",
    "draft_length": "drafted tokens per chain",
    "budget": "drafted nodes per step",
    "draft_model": "a draft model (hub id or folder)",
    "exit_layer": "the layer to exit after",
    "depth": "the deepest a dynamic tree grows",
}
INT_OPTIONS = ("draft_length", "budget", "exit_layer", "depth")


@dataclass(frozen=True)
class DrafterSpec:
    help: str
    build: Callable[..., Drafter]  # build(model, **options) with the options below that were given
    options: tuple[str, ...] = ()  # the options it takes (keys of OPTIONS)
    required: tuple[str, ...] = ()  # of those, the ones it cannot do without
    uses_heads: bool = True  # it drafts with the model's heads (the tree's depth is bounded by them)


@lru_cache(maxsize=1)
def _batching() -> dict:
    return read_json(Path(str(resources.files("medusa_heads.configs") / "batching.json")), "Batching table", "")


def _dtype_key(dtype: torch.dtype) -> str:
    return "float32" if dtype == torch.float32 else "bfloat16"


def default_drafter(dtype: torch.dtype, batch_size: int = 1) -> tuple[str, dict]:
    r"""
    (drafter name, options) for rows of a batch of `batch_size` in `dtype` when the user names none: the fastest
    lossless configuration measured on this project's CPU (`configs/batching.json`), from a tree that pays alone
    down to no drafts in large batches. The default heads draft; `default_configuration` may pick other heads.
    """
    rules = _batching()[_dtype_key(dtype)]
    rule = next(r for r in rules if batch_size <= r.get("up_to", batch_size))
    return rule["drafter"], {k: v for k, v in rule.items() if k not in ("up_to", "drafter")}


@dataclass(frozen=True)
class Configuration:
    """A lossless configuration to run when the user names none: a drafter with its options, the heads it drafts
    with and their weights' quantization; `tuned_on` is the date `medusa-heads tune` chose it on this machine."""

    drafter: str
    options: dict = field(default_factory=dict)
    heads: str | None = None  # a folder of medusa_heads/pretrained/; None: the heads shipped for the backbone
    quantize_drafter: str = "none"
    tuned_on: str | None = None

    @property
    def heads_path(self) -> str | None:
        return str(resources.files("medusa_heads") / "pretrained" / self.heads) if self.heads else None

    @property
    def source(self) -> str:
        """Where the choice came from, for the configuration line."""
        if self.tuned_on:
            return f"tuned on this machine {self.tuned_on}"
        return "the project's table; run `medusa-heads tune` to pick for this machine"

    def settings(self) -> dict:
        """What it runs, as `medusa-heads tune` records it."""
        return {"heads": self.heads, "drafter": self.drafter, "options": self.options,
                "quantize_drafter": self.quantize_drafter}

    def __str__(self) -> str:
        options = ", ".join(f"{k} {v}" for k, v in self.options.items())
        return (self.drafter + (f" ({options})" if options else "")
                + (f", heads {self.heads}" if self.heads else ", the default heads")
                + (f", {self.quantize_drafter} drafter weights" if self.quantize_drafter != "none" else ""))


@lru_cache(maxsize=1)
def _tuning() -> dict:
    return read_json(Path(str(resources.files("medusa_heads.configs") / "tune.json")), "Tuning candidates", "")


def tune_candidates(dtype: torch.dtype) -> list[Configuration]:
    """The lossless batch-1 configurations `medusa-heads tune` times in `dtype`: the table's, then those of
    `configs/tune.json`."""
    listed = [Configuration(c["drafter"], c["options"], c["heads"], c["quantize_drafter"])
              for c in _tuning()["candidates"][_dtype_key(dtype)]]
    return [Configuration(*default_drafter(dtype)), *listed]


def tuning_prompts() -> list[str]:
    """The prompts `medusa-heads tune` times the candidates on (written for this project, not the benchmark's)."""
    return [row["prompt"] for row in _tuning()["prompts"]]


def default_configuration(dtype: torch.dtype, batch_size: int = 1,
                          device: str | torch.device = "cpu") -> Configuration:
    r"""
    What `generate` and `serve` run in `dtype` on `device` when the user names no drafter, tree, heads or backbone:
    at batch 1 the configuration `medusa-heads tune` recorded as the fastest for this device, dtype and thread
    count; else, or without such a record, the table's (`default_drafter`). The heads are part of it: load
    `heads_path` (None: the default heads).
    """
    if batch_size == 1 and (tuned := tuned_choice(dtype, torch.device(device), tune_candidates(dtype))) is not None:
        return tuned
    return Configuration(*default_drafter(dtype, batch_size))


def heads_drafter(model: MedusaModel, tree: TreeBuffers) -> MedusaDrafter | EagleDrafter | Eagle3TreeDrafter:
    """The drafter for the model's own heads on a static tree, by what the heads can do."""
    if fast_eagle3_supports(model.heads):
        return Eagle3TreeDrafter(model, tree)
    return EagleDrafter(model, tree) if model.heads.drafts_over_context else MedusaDrafter(model, tree)


def heads_store(model: MedusaModel) -> NgramStore:
    """The n-gram store saved with the model's heads; a one-line error when they have none."""
    store = model.ngram_store
    heads_path = model.heads.name_or_path
    if store is None:
        raise MedusaError(f"The heads `{heads_path or '(in memory)'}` have no {STORE_FILE}: build one with "
                          "`medusa-heads ngram-store DATA --heads FOLDER`.")
    if store.vocab_size != model.config.vocab_size:
        raise MedusaError(f"The n-gram store of `{heads_path}` is for a vocabulary of {store.vocab_size} tokens, "
                          f"the heads have {model.config.vocab_size}.")
    return store


def _heads(model: MedusaModel, tree: str = DEFAULT_TREE) -> Drafter:
    return heads_drafter(model, build_tree(load_tree(tree), model.device))


def _dynamic(model: MedusaModel, budget: int = 16, depth: int | None = None) -> Drafter:
    return DynamicDrafter(model, budget, max_depth=depth)


def _plus_ngram(base: str, what: str, shape: tuple[str, ...], inner: Callable[..., Drafter],
                chained: Callable[..., Drafter]) -> dict[str, DrafterSpec]:
    """`BASE+ngram` and `BASE+ngram+store`: the drafter `inner(model, **shape_options)` plus the n-gram chain
    (`chained`), the chain from the context alone or, failing that, from the heads' n-gram store. The options are
    the shape's first, the chain's length, then the shape's others (the order of a bench method's fields)."""
    options = (shape[0], "draft_length", *shape[1:])
    def build(store: bool) -> Callable[..., Drafter]:
        def make(model: MedusaModel, draft_length: int = 6, **shape_option) -> Drafter:
            return chained(inner(model, **shape_option), ngram_length=draft_length,
                           store=heads_store(model) if store else None)
        return make
    return {
        f"{base}+ngram": DrafterSpec(f"{what} plus a prompt-lookup chain, verified in the same forward", build(False),
                                     options),
        f"{base}+ngram+store": DrafterSpec(f"as {base}+ngram, the chain drafted from the heads' n-gram store when "
                                           "the context has no match", build(True), options),
    }


def _draft_model(model: MedusaModel, draft_model, draft_length: int = 4) -> Drafter:
    if isinstance(draft_model, str):
        draft_model = load_backbone(draft_model, dtype=model.backbone.dtype, device=model.device)
    return DraftModelDrafter(model, draft_model, draft_length)


DRAFTERS: dict[str, DrafterSpec] = {
    "medusa": DrafterSpec("the heads' top-k guesses fill a static tree", _heads, ("tree",)),
    **_plus_ngram("medusa", "the heads' tree", ("tree",), _heads, MedusaNgramDrafter),
    "ngram": DrafterSpec("prompt lookup alone, as a chain", lambda model, draft_length=6: NgramDrafter(
        draft_length, device=model.device), ("draft_length",), uses_heads=False),
    "draft-model": DrafterSpec("a small LM with the backbone's tokenizer drafts a chain", _draft_model,
                               ("draft_model", "draft_length"), ("draft_model",), uses_heads=False),
    "early-exit": DrafterSpec("the backbone's first layers draft a chain",
                              lambda model, exit_layer, draft_length=4: EarlyExitDrafter(model, exit_layer,
                                                                                         draft_length),
                              ("exit_layer", "draft_length"), ("exit_layer",), uses_heads=False),
    "dynamic": DrafterSpec("a tree grown each step from the heads' confidence (default 16 nodes)", _dynamic,
                           ("budget", "depth")),
    **_plus_ngram("dynamic", "the dynamic tree", ("budget", "depth"), _dynamic, DynamicNgramDrafter),
    "adaptive": DrafterSpec("a dynamic tree whose size is chosen each step (up to 32 nodes by default)",
                            lambda model, budget=32, depth=None: AdaptiveDrafter(model, budget, max_depth=depth),
                            ("budget", "depth")),
    "plain": DrafterSpec("no drafts: one token per forward (the baseline)", lambda model: PlainDrafter(model.device),
                         uses_heads=False),
}


def drafters_taking(option: str) -> list[str]:
    return [name for name, spec in DRAFTERS.items() if option in spec.options]


def _described(option: str) -> str:
    """`draft_length` (--draft-length: drafted tokens per chain): the option as Python and the CLI name it."""
    return f"`{option}` (--{option.replace('_', '-')}: {OPTIONS[option]})"


def check_drafter_options(name: str, **options) -> dict:
    """The options given (not None) for drafter `name`, checked before any model loads; one-line errors for an
    unknown drafter, an option it does not take, a missing required one, or a bad value."""
    if name not in DRAFTERS:
        raise MedusaError(f"Unknown drafter `{name}`; use one of {', '.join(DRAFTERS)}.")
    spec = DRAFTERS[name]
    given = {k: v for k, v in options.items() if v is not None}
    for key, value in given.items():
        if key not in OPTIONS:
            raise MedusaError(f"Unknown drafter option `{key}`; known: {', '.join(OPTIONS)}.")
        if key not in spec.options:
            raise MedusaError(f"{_described(key)} does not apply to the {name} drafter; it applies to "
                              f"{', '.join(drafters_taking(key))}.")
        least = 0 if key == "budget" else 1  # a budget of 0 is plain decoding
        if key in INT_OPTIONS and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise MedusaError(f"{_described(key)} must be an integer >= {least}, got {value!r}.")
    for key in spec.required:
        if key not in given:
            raise MedusaError(f"The {name} drafter needs {_described(key)}.")
    if "tree" in given:
        load_tree(given["tree"])  # a broken tree fails now
    return given


def make_drafters(model: MedusaModel, name: str, count: int, **options) -> list[Drafter]:
    """`count` drafters for sequences decoded together: the same one repeated when it keeps no state per
    sequence, else one each (a draft model is loaded once and shared)."""
    given = check_drafter_options(name, **options)
    if isinstance(given.get("draft_model"), str):
        given["draft_model"] = load_backbone(given["draft_model"], dtype=model.backbone.dtype, device=model.device)
    first = DRAFTERS[name].build(model, **given)
    if not getattr(first, "per_sequence", False):
        return [first] * count
    return [first] + [DRAFTERS[name].build(model, **given) for _ in range(count - 1)]


def make_drafter(model: MedusaModel, name: str = "medusa", **options) -> Drafter:
    r"""
    A drafter by its registry name, e.g. `make_drafter(model, "medusa+ngram", tree="cpu-16", draft_length=10)`.
    Options left out (or None) take the drafter's defaults; see `DRAFTERS` for which each takes.
    """
    given = check_drafter_options(name, **options)
    return DRAFTERS[name].build(model, **given)


@dataclass(frozen=True)
class AcceptanceSpec:
    help: str
    build: Callable[..., Acceptance]  # build(temperature, epsilon, delta, top_k, top_p, generator)
    top_k_top_p: bool = False  # it takes HF's top-k and top-p warpers


ACCEPTANCE_RULES: dict[str, AcceptanceSpec] = {
    "greedy": AcceptanceSpec("the backbone's greedy output, exactly", lambda **_: GreedyAcceptance()),
    "exact": AcceptanceSpec(
        "sampling, exactly the backbone's distribution",
        lambda temperature, top_k, top_p, generator, **_: ExactAcceptance(temperature, top_k, top_p, generator),
        top_k_top_p=True),
    "typical": AcceptanceSpec(
        "Medusa's faster, lossy sampling (temperature default 0.7)",
        lambda temperature, epsilon, delta, generator, **_: TypicalAcceptance(temperature or 0.7, epsilon, delta,
                                                                              generator)),
}


def make_acceptance(name: str, temperature: float = 0.0, epsilon: float = 0.09, delta: float = 0.3,
                    seed: int | None = None, device: str | torch.device = "cpu", top_k: int = 0,
                    top_p: float = 1.0) -> Acceptance:
    """An acceptance rule by its registry name; `device` is where the logits will be."""
    if name not in ACCEPTANCE_RULES:
        raise MedusaError(f"Unknown acceptance `{name}`; use one of {', '.join(ACCEPTANCE_RULES)}.")
    spec = ACCEPTANCE_RULES[name]
    if not spec.top_k_top_p and (top_k != 0 or top_p != 1.0):
        takers = ", ".join(n for n, rule in ACCEPTANCE_RULES.items() if rule.top_k_top_p)
        raise MedusaError(f"`top_k` and `top_p` apply to {takers} acceptance only, not to {name}.")
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return spec.build(temperature=temperature, epsilon=epsilon, delta=delta, top_k=top_k, top_p=top_p,
                      generator=generator)
