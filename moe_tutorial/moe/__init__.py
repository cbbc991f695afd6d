"""The model the course teaches: config, routing, the dispatcher, the experts (`experts/`,
whose `naive.py` is the reference loop), the model, HF interop."""
