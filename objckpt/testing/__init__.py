"""Test servers (moto, LocalStack) for objckpt's tests, benchmarks and demo."""
