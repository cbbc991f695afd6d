"""The model the course teaches: config, routing, experts, the model, HF interop."""
