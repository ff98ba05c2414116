"""jaxserve.tokenizer: tokenizer loading, streaming detokenization, chat templates."""

from jaxserve.tokenizer.chat_template import ChatTemplateError, render_chat_template, validate_messages
from jaxserve.tokenizer.detokenizer import IncrementalDetokenizer
from jaxserve.tokenizer.tokenizer import Tokenizer, TokenizerLoadError

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerLoadError",
    "render_chat_template",
    "validate_messages",
]
