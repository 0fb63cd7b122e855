//! The PostgreSQL side: the table's shape and the batch insert.

use std::time::SystemTime;

use tokio_postgres::Client;

use crate::row::Row;

/// `CREATE TABLE IF NOT EXISTS` for `table` (already quoted), and its
/// schema when it names one.
///
/// Columns: `msg_id text PRIMARY KEY` (`Nats-Msg-Id`), `stream_seq bigint`,
/// `subject text`, `topic text`, `qos smallint`, `retain boolean`,
/// `client_id text`, `workspace text` (NULL: the default workspace),
/// `payload bytea`, `received_at timestamptz` (when the stream stored the
/// value), `written_at timestamptz` (when this program committed it).
///
/// # Errors
///
/// PostgreSQL refuses (no permission, a table of that name with another
/// shape is left as it is and fails later on insert).
pub async fn create_table(client: &Client, table: &str) -> Result<(), tokio_postgres::Error> {
    if let Some((schema, _)) = table.split_once('.') {
        client
            .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
            .await?;
    }
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                 msg_id      text PRIMARY KEY,
                 stream_seq  bigint NOT NULL,
                 subject     text NOT NULL,
                 topic       text,
                 qos         smallint,
                 retain      boolean NOT NULL DEFAULT false,
                 client_id   text,
                 workspace   text,
                 payload     bytea NOT NULL,
                 received_at timestamptz NOT NULL,
                 written_at  timestamptz NOT NULL DEFAULT now()
             )"
        ))
        .await
}

/// Writes `rows` in one transaction with one statement (arrays unnested),
/// skipping those whose `msg_id` is already in the table (`ON CONFLICT DO
/// NOTHING`: a value delivered again after a crash between commit and
/// acknowledgement is not written twice). Returns how many rows were new.
///
/// # Errors
///
/// PostgreSQL failed or the connection broke; nothing was committed unless
/// the failure came after the commit (a retry then writes nothing twice).
pub async fn write_batch(
    client: &mut Client,
    table: &str,
    rows: &[Row],
) -> Result<u64, tokio_postgres::Error> {
    let msg_ids: Vec<&str> = rows.iter().map(|r| r.msg_id.as_str()).collect();
    let seqs: Vec<i64> = rows.iter().map(|r| r.stream_seq).collect();
    let subjects: Vec<&str> = rows.iter().map(|r| r.subject.as_str()).collect();
    let topics: Vec<Option<&str>> = rows.iter().map(|r| r.topic.as_deref()).collect();
    let qos: Vec<Option<i16>> = rows.iter().map(|r| r.qos).collect();
    let retain: Vec<bool> = rows.iter().map(|r| r.retain).collect();
    let client_ids: Vec<Option<&str>> = rows.iter().map(|r| r.client_id.as_deref()).collect();
    let workspaces: Vec<Option<&str>> = rows.iter().map(|r| r.workspace.as_deref()).collect();
    let payloads: Vec<&[u8]> = rows.iter().map(|r| r.payload.as_ref()).collect();
    let received: Vec<SystemTime> = rows.iter().map(|r| r.received_at).collect();

    let transaction = client.transaction().await?;
    let inserted = transaction
        .execute(
            &format!(
                "INSERT INTO {table} (msg_id, stream_seq, subject, topic, qos, retain, client_id, \
                 workspace, payload, received_at) \
                 SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], \
                 $5::smallint[], $6::boolean[], $7::text[], $8::text[], $9::bytea[], \
                 $10::timestamptz[]) \
                 ON CONFLICT (msg_id) DO NOTHING"
            ),
            &[
                &msg_ids,
                &seqs,
                &subjects,
                &topics,
                &qos,
                &retain,
                &client_ids,
                &workspaces,
                &payloads,
                &received,
            ],
        )
        .await?;
    transaction.commit().await?;
    Ok(inserted)
}
