"""jaxserve.tokenizer"""
