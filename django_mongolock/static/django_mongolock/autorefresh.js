'use strict';
// Reloads the lock list every data-seconds seconds, keeping its filters (they are in the
// URL). It waits while locks are selected or a field has focus, so a reload never throws
// away what the operator was doing.
{
    const switcher = document.getElementById('mongolock-autorefresh');
    if (switcher) {
        const seconds = Math.max(1, Number(switcher.dataset.seconds) || 0);
        const paused = switcher.querySelector('.mongolock-refresh-paused');

        function busy() {
            if (document.querySelector('#result_list input.action-select:checked')) {
                return true;
            }
            const field = document.activeElement;
            return Boolean(field && field.matches('input[type=text], input[type=search], select, textarea'));
        }

        function tick() {
            if (busy()) {
                if (paused) {
                    paused.classList.remove('hidden');
                }
                window.setTimeout(tick, 1000);
            } else {
                window.location.reload();
            }
        }

        window.setTimeout(tick, seconds * 1000);
    }
}
