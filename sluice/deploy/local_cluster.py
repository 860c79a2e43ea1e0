"""Start and stop the embedded local Ray cluster and Serve, on loopback only."""

from __future__ import annotations

from base.runtime import DEFAULT_SERVE_PROXY_PORT, LOOPBACK, apply_process_env, ray_temp_dir


def start_local_cluster(
    serve_proxy_port: int = DEFAULT_SERVE_PROXY_PORT, num_cpus: int | None = None, log_to_driver: bool = True
) -> None:
    """A fresh local Ray (127.0.0.1, no dashboard) with Serve; replicas bind `LOOPBACK`. Without `log_to_driver`
    the workers' logs (vLLM's among them) stay in Ray's log folder."""
    env = apply_process_env()
    import ray
    from ray import serve

    from services.serve_internals import ray_resolves_node_ip_to_loopback

    if not ray_resolves_node_ip_to_loopback():
        raise RuntimeError(
            "Ray was imported before base.runtime.apply_process_env(); it would bind the machine's "
            "address instead of 127.0.0.1. Call apply_process_env() before importing ray."
        )

    ray_temp_dir().mkdir(parents=True, exist_ok=True)
    ray.init(
        address="local",
        _node_ip_address=LOOPBACK,
        include_dashboard=False,
        _temp_dir=str(ray_temp_dir()),
        num_cpus=num_cpus,
        runtime_env={"env_vars": env},
        log_to_driver=log_to_driver,
    )
    serve.start(http_options={"host": LOOPBACK, "port": serve_proxy_port})


def stop_local_cluster() -> None:
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
