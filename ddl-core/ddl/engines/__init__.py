"""Communication engines. Each one runs collectives among a group of ranks."""
