"""Training data: tokenizers, sources read through HF `datasets`, the O(1) sample order, per-stage loaders."""

from nanoflow.data.loader import StageLoader, open_stage
from nanoflow.data.order import SampleOrder, sample_order
from nanoflow.data.sources import IGNORE_INDEX, PackedText, SFTExamples, expand_data_files, load_rows, open_source
from nanoflow.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX", "ByteTokenizer", "HFTokenizer", "PackedText", "SFTExamples", "SampleOrder", "StageLoader",
    "expand_data_files", "load_rows", "load_tokenizer", "open_source", "open_stage", "sample_order",
]
