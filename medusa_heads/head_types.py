"""The registry of head types: `MedusaConfig.head_type` -> the class that builds, loads and describes it.

Adding a head type means writing its class (a `DraftHeads` subclass declaring its capabilities) and listing it
here; the loader, the runtime and the trainer find it through this registry and read its capabilities.
"""

from .eagle import EagleHead
from .eagle3 import Eagle3Head
from .errors import MedusaError
from .heads import DraftHeads, HydraHeads, MedusaHeads

HEAD_TYPES: dict[str, type[DraftHeads]] = {cls.head_type: cls for cls in (MedusaHeads, HydraHeads, EagleHead, Eagle3Head)}


def head_type_class(name: str) -> type[DraftHeads]:
    """The class of head type `name`, or a one-line error listing the known ones."""
    if name not in HEAD_TYPES:
        raise MedusaError(f"Unknown head type `{name}`; use one of {', '.join(HEAD_TYPES)}.")
    return HEAD_TYPES[name]
