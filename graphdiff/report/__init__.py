"""What a scan says, for people: summary lines, `explain`/`replay`, the HTML report and its dataflow pictures."""
