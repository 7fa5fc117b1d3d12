"""Hugging Face interop: weight mapping per architecture, import/export of GLOBAL checkpoints, generation.

Needs the ``hf`` extra (``transformers``, ``safetensors``, ``tokenizers``), imported only when a
function here is called.
"""

from tierstack.hf.architectures import ARCHITECTURES, UnsupportedModelError
from tierstack.hf.convert import HFCheckpointError, export_hf, import_hf, is_hf_directory

__all__ = ["ARCHITECTURES", "HFCheckpointError", "UnsupportedModelError", "export_hf", "import_hf", "is_hf_directory"]
