use std::path::PathBuf;
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli { #[command(subcommand)] cmd: Cmd }
#[derive(Subcommand)]
enum Cmd { Gen { #[arg(long)] out: PathBuf, #[arg(long, default_value_t = 100000)] train_rows: u64, #[arg(long, default_value_t = 20000)] test_rows: u64, #[arg(long, default_value_t = 1)] seed: u64 } }
fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd { Cmd::Gen { out, train_rows, test_rows, seed } => { let t = sparrow_data::synth::generate(&out, train_rows, test_rows, seed)?; println!("{}", serde_json::to_string(&t)?); } }
    Ok(())
}
