"""Launchers (local multi-process, Ray actors, KubeRay manifests): not built yet.

The local multi-process launcher lives in ``megaserve.runtime`` for now; Ray and KubeRay
launchers that consume ``planner`` plan files are future work.
"""
