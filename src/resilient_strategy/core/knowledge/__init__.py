"""Field knowledge: the known-issue rules, the failure signatures, the remedies, the causes, and
the TOML tables they are read from (the one list of them: `data.DATA_FILES`)."""
