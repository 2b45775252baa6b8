"""How a repository is launched: discovering launch lines and scripts, writing trainbridge.toml."""
