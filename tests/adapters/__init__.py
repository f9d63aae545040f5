"""Small trainer adapters for tests/compiler/test_trainer_adapter.py, good and broken."""
