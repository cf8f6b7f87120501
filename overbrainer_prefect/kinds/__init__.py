"""The kinds of job, one module each: what a job asks, where its record
lives, how its trainer is made from its record, how a finished or running one
is found for reuse, its result and its summary (`training`, `export`,
`base_export`, `compare`, `evaluation`); `registry` finds a record's kind."""
