"""Training data: tokenizers, sources (HF `datasets`, token folders), blending, the O(1) sample order, per-stage loaders.

What a user calls is here: the run's tokenizer, a stage's loader, the sample order, token folders and
their writer, and the errors to catch. The parts (sources, blends, the HF reading) are in their modules.
"""

from nanoflow.data.loader import SampleReadError, open_stage
from nanoflow.data.order import sample_order
from nanoflow.data.sources import IGNORE_INDEX
from nanoflow.data.tokenizer import ByteTokenizer, TokenizerError, load_run_tokenizer, load_tokenizer
from nanoflow.data.tokens import StageDataError, TokenFolder, TokenFolderError, write_token_file

__all__ = [
    "IGNORE_INDEX", "ByteTokenizer", "SampleReadError", "StageDataError", "TokenFolder", "TokenFolderError",
    "TokenizerError", "load_run_tokenizer", "load_tokenizer", "open_stage", "sample_order", "write_token_file",
]
