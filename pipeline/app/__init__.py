"""The top layer: the `bonsai` CLI, the HTTP API and web page, and the views they share."""
