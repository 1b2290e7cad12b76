"""The local mesh: `kvmesh up` (Redis, engines with sidecars, router as local processes) and `kvmesh status`. May depend on every component."""
