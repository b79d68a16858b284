"""The OpenAI Batch API (docs/batch.md): files and batches in a durable SQLite store (`store.py`), the
HTTP routes (`routes.py`), the checks of an uploaded file and of a new batch (`files.py`), and the
runner that answers a batch's lines through the API's own pipeline (`runner.py`)."""
