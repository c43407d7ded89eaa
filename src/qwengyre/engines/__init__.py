"""Inference engines behind one interface: scripted (tests, demos), embedded, SGLang."""
