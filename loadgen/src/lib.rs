//! fleetmq-loadgen: an MQTT load generator built like the broker (glommio,
//! one executor per `--threads`), encoding through `fleetmq_core`'s codec.
//!
//! Modules by subsystem: [`options`] (the command line), [`schedule`] (the
//! open-loop send schedule), [`latency`] (histograms), [`client`] (the lean
//! MQTT client), [`transport`] (TCP, TLS and WebSocket streams under it),
//! [`runtime`] (executors, shared counters, signals),
//! [`flow`] and [`connections`] (the scenarios), [`scenario`] (the
//! coordinating thread), [`report`] (summary and JSON), [`compare`], [`retained`] (many retained messages and a
//! subscriber that wants them all), [`suback`] (SUBACK times, and a value
//! published elsewhere right after each).

pub mod client;
pub mod compare;
pub mod connections;
pub mod flow;
pub mod inflight;
pub mod latency;
pub mod options;
pub mod proxy;
pub mod report;
pub mod retained;
pub mod runtime;
pub mod scenario;
pub mod schedule;
pub mod suback;
pub mod transport;
pub mod verify;
