"""Other tools' formats: HF export, nanotron's config converter and key table, the TOML writer."""
