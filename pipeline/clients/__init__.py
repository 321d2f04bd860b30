"""Clients for the outside world (the Hugging Face hub), passed to the stages that need them."""
