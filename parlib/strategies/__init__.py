"""Ways to split training over ranks: one module per strategy."""
