"""Front ends that serve the engine over a network protocol (``openai``: ``deepinfer serve``)."""
