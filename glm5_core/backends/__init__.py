"""Built-in backends. Each vendor folder lives at the repository's top-level ``backends/<vendor>/``
and is installed as ``glm5_core.backends.<vendor>``; importing this package imports no vendor SDK."""
