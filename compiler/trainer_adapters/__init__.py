"""Trainer adapters shipped with weightplan: trainers that are not transformers models, for `--trainer-adapter`."""
