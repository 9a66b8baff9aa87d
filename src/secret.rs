//! The job's secret: where it comes from (a variable, or a per-user file made with a random
//! secret when absent, as ssh keys are kept), and the checks that keep it from being empty,
//! short, or readable by others. [`crate::config`] gives it the environment's values.

use crate::{KvError, Result};

/// The job's secret: `KVSTORE_SECRET`, else the file `KVSTORE_SECRET_FILE` names, else
/// `~/.kvstore/secret` (made with a random secret when absent). Never empty, never short,
/// never from a file others can read.
pub(crate) fn resolve(
    secret: Option<String>,
    file: Option<String>,
    home: Option<String>,
) -> Result<String> {
    let how = "set KVSTORE_SECRET (16 bytes or more, the same in every process of the job; \
               kvrun draws one), or KVSTORE_SECRET_FILE";
    let s = match (secret, file) {
        (Some(s), _) => s,
        (None, Some(f)) => read_secret_file(std::path::Path::new(&f))?,
        (None, None) => match home {
            Some(h) => secret_file(&std::path::Path::new(&h).join(".kvstore"))?,
            None => return Err(KvError::Config(format!("no job secret: {how}"))),
        },
    };
    if s.len() < crate::auth::MIN_SECRET {
        return Err(KvError::Config(format!(
            "the job secret has {} bytes, fewer than {}: {how}",
            s.len(),
            crate::auth::MIN_SECRET
        )));
    }
    Ok(s)
}

/// The secret in `path`, refused unless this user owns it and no one else may read it.
fn read_secret_file(path: &std::path::Path) -> Result<String> {
    use std::os::unix::fs::MetadataExt;
    let bad = |why: String| KvError::Config(format!("secret file {}: {why}", path.display()));
    let m = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if m.uid() != rustix::process::geteuid().as_raw() {
        return Err(bad("owned by another user".into()));
    }
    if m.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "mode {:o}: others may read it (chmod 600)",
            m.mode() & 0o777
        )));
    }
    let s = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    Ok(s.trim().to_string())
}

/// The per-user secret in `dir/secret`, made (32 random bytes, hex, mode 0600, in a 0700
/// directory) when there is none: written to a file of its own first and then linked into
/// place, so that processes starting at once all read the one that won.
fn secret_file(dir: &std::path::Path) -> Result<String> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let path = dir.join("secret");
    if !path.exists() {
        let bad = |e: std::io::Error| {
            KvError::Config(format!(
                "cannot make the secret file {}: {e}",
                path.display()
            ))
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(bad)?;
        let tmp = dir.join(format!("secret.{}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(bad)?;
        let s = crate::auth::hex(&crate::auth::random::<32>().map_err(bad)?);
        f.write_all(s.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(bad)?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(bad(e)),
            _ => {}
        }
    }
    read_secret_file(&path)
}
