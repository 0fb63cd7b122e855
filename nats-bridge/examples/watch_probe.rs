//! Prints what a `watch_all` of a bucket yields (a debugging aid).
use futures_util::StreamExt;
fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut args = std::env::args().skip(1);
        let url = args.next().unwrap();
        let bucket = args.next().unwrap();
        let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
        let mut stream = js.get_stream(format!("KV_{bucket}")).await.unwrap();
        println!("state {:?}", stream.info().await.unwrap().state);
        let kv = js.get_key_value(&bucket).await.unwrap();
        println!("kv {:?} {:?} {:?}", kv.name, kv.stream_name, kv.prefix);
        match kv.keys().await {
            Ok(mut keys) => while let Ok(Some(k)) = tokio::time::timeout(std::time::Duration::from_secs(2), keys.next()).await { println!("key {k:?}"); },
            Err(e) => println!("keys error {e}"),
        }
        let mut w = kv.watch_with_history(">").await.unwrap();
        while let Ok(Some(e)) = tokio::time::timeout(std::time::Duration::from_secs(2), w.next()).await {
            match e {
                Ok(e) => println!("{} rev {} delta {} op {:?} seen {}", e.key, e.revision, e.delta, e.operation, e.seen_current),
                Err(e) => println!("watch error {e:?}"),
            }
        }
        println!("watch done");
    });
}
