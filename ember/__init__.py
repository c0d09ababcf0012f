"""ember: GGUF language models on a NumPy engine, with an experiment hook contract.

    import ember
    model = ember.load_model("smollm2-135m")
    print(model.generate("The capital of France is", max_new_tokens=16).text)
"""

from ember.errors import EmberError

__version__ = "0.1.0"

__all__ = ["EmberError", "Generation", "Model", "Tokenizer", "__version__", "load_model"]


def __getattr__(name: str):
    # The engine imports NumPy, BLAS and the tokenizer; keep `import ember` itself light.
    if name in ("load_model", "Model", "Generation"):
        from ember import model

        return getattr(model, name)
    if name == "Tokenizer":
        from ember.tokenizer import Tokenizer

        return Tokenizer
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
