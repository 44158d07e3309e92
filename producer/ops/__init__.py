"""Operations on jobs after enqueue that a library caller may run too: export, output
formats, stored schedules. They stand on the producer, which never imports them back."""
