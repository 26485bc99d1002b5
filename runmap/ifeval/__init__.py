"""IFEval: generate responses with the engine and score them with the official checkers."""
