"""Launchers: local multi-process, Ray actors, KubeRay manifests."""
