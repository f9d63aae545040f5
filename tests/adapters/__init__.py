"""Small trainer adapters for tests/test_trainer_adapter.py, good and broken."""
