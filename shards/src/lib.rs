//! fleetmq server.
