"""Long-running processes: the registry watcher (a thread of `fastfill serve`) and the webhook
receiver (`fastfill webhook serve`). Both start upgrades through the deployments of
flows/deployments.py."""
