"""Engine servers: the built-in HF server and the real SGLang launcher."""
