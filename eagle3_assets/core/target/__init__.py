"""The target model as every stage sees it: its description, identity, tokenizer, head, pre-flight and serving."""
