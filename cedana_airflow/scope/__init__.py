"""Who may be checkpointed: the operator's opt-in list (``optin``) and the DAG authors' tags (``tags``)."""

__all__ = ["optin", "tags"]
