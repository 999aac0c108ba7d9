"""Per-dimension algorithms (ring, halving-doubling, engine-native) and the DDL
multi-dimensional allreduce that composes them."""
