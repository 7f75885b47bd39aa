"""Training data: tokenizers, sources (HF `datasets`, token folders), blending, the O(1) sample order, per-stage loaders."""

from nanoflow.data.blend import Blend
from nanoflow.data.hf_datasets import expand_data_files, load_rows
from nanoflow.data.loader import DataError, StageLoader, check_stages, open_stage, source_position
from nanoflow.data.order import SampleOrder, sample_order
from nanoflow.data.sources import (
    IGNORE_INDEX,
    NamedSource,
    PackedText,
    SFTExamples,
    open_source,
    open_sources,
)
from nanoflow.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_run_tokenizer, load_tokenizer
from nanoflow.data.tokens import (
    DataInputError,
    TokenFolder,
    TokenFolderError,
    write_token_file,
)

__all__ = [
    "IGNORE_INDEX", "Blend", "ByteTokenizer", "DataError", "DataInputError", "HFTokenizer", "NamedSource",
    "PackedText", "SFTExamples", "SampleOrder", "StageLoader", "TokenFolder", "TokenFolderError", "TokenizerError",
    "check_stages", "expand_data_files", "load_rows", "load_run_tokenizer", "load_tokenizer", "open_source",
    "open_sources", "open_stage", "sample_order", "source_position", "write_token_file",
]
