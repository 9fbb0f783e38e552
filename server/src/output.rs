//! How the CLI prints a listing: `-o table` (aligned columns with a header, for people) or `-o json` (one JSON object
//! a line, for scripts: `jq`, `while read`). Times are UTC, labelled so in the header.

use comfy_table::{Table, presets};
use serde::Serialize;

/// A listing's format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Aligned columns with a header.
    Table,
    /// One JSON object a line.
    Json,
}

/// A column of a table: its header, and its cell of a row.
pub type Column<'a, T> = (&'a str, &'a dyn Fn(&T) -> String);

/// Prints `rows` as `output` says: a table of `columns`, or each row as a JSON line.
pub fn print<T: Serialize>(output: Output, rows: &[T], columns: &[Column<'_, T>]) -> anyhow::Result<()> {
    match output {
        Output::Json => {
            for row in rows {
                println!("{}", serde_json::to_string(row)?);
            }
        }
        Output::Table => {
            let mut table = Table::new();
            table.load_style(presets::NOTHING);
            table.set_header(columns.iter().map(|(header, _)| *header));
            for row in rows {
                table.add_row(columns.iter().map(|(_, cell)| cell(row)));
            }
            // Columns two spaces apart, the first at the margin (`grep '^name '` finds a row).
            for column in table.column_iter_mut() {
                column.set_padding((0, 2));
            }
            println!("{}", table.trim_fmt());
        }
    }
    Ok(())
}

/// A time as a table cell: UTC to the second (the header says UTC).
pub fn time(at: &chrono::DateTime<chrono::Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// An optional value as a table cell, `-` when absent.
pub fn maybe<T: ToString>(value: &Option<T>) -> String {
    value.as_ref().map_or_else(|| "-".to_owned(), T::to_string)
}
