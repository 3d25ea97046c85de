package pubsub

import "time"

// rareWarningEvery is how often a warning that can come per message is
// logged while its cause lasts (rarelog): whoever may publish on the
// prefix's shard channels can send any number of malformed announcements,
// and every keyed publish meets a Redis that is down; 500 malformed
// announcements made 500 lines.
const rareWarningEvery = time.Minute
