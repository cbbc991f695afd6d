"""Repository tooling run from a checkout: environment setup, README generation."""
