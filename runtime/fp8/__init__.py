"""fp8 128x128 block quantization numerics and the numba kernel behind them."""
